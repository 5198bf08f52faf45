//! Why a claim does not fit: structured, serialisable, printable.

use std::fmt;

use serde::Serialize;

/// The explanation for a claim that does not fit on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// The node allocation was tried on.
    pub node: String,
    /// Pools of the node that cannot be used, with the reason.
    pub unusable_pools: Vec<PoolNote>,
    /// One entry per request and per `firstAvailable` subrequest.
    pub requests: Vec<RequestExplanation>,
    /// Problems that only show when requests are combined (constraints, devices
    /// wanted by several requests, counters shared between the picks).
    pub combination: Vec<String>,
    /// What would make a request fit: per device held by other claims, the
    /// fewest claims to release; ordered by that number, then device order.
    pub suggestions: Vec<Suggestion>,
}

/// A device that a request would get if some claims released what they hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Suggestion {
    /// `<req>` or `<req>/<sub>`.
    pub request: String,
    /// `pool/device`.
    pub device: String,
    /// The MIG profile of the device (its `profile` attribute), if any.
    pub profile: Option<String>,
    /// The physical GPU (`gpu-<i>`) of a carve device name.
    pub gpu: Option<String>,
    /// The memory slices of a MIG placement.
    pub slices: Option<SliceRange>,
    /// The claims to release, each with its devices that are in the way.
    pub release: Vec<Release>,
    /// True when no smaller set of claims would do (the search was exhaustive);
    /// false when the search budget ran out and the set is only irreducible.
    pub minimum: bool,
}

/// An inclusive range of memory slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SliceRange {
    /// First slice.
    pub first: i64,
    /// Last slice.
    pub last: i64,
}

/// A claim to release and its devices in the way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Release {
    /// `namespace/name`.
    pub claim: String,
    /// Device names (in the device's pool) that overlap the suggested device.
    pub devices: Vec<String>,
}

impl fmt::Display for SliceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "slice {}", self.first)
        } else {
            write!(f, "slices {}\u{2013}{}", self.first, self.last)
        }
    }
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.profile {
            Some(p) => write!(f, "{p}")?,
            None => write!(f, "request {}", self.request)?,
        }
        let name = self.device.rsplit('/').next().unwrap_or(&self.device);
        match (&self.gpu, &self.slices) {
            (Some(g), Some(s)) => write!(f, " fits on {g} at {s}")?,
            _ => write!(f, " fits on {name}")?,
        }
        for (i, r) in self.release.iter().enumerate() {
            let lead = if i == 0 { " if" } else { " and" };
            write!(
                f,
                "{lead} claim {} releases {}",
                r.claim,
                r.devices.join(", ")
            )?;
        }
        if !self.minimum {
            write!(f, " (search budget spent; a smaller set may exist)")?;
        }
        Ok(())
    }
}

/// A pool that cannot be allocated from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolNote {
    /// `driver/pool`.
    pub pool: String,
    /// Why.
    pub reason: String,
}

/// How one request (or subrequest) fares on its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestExplanation {
    /// `<req>` or `<req>/<sub>`.
    pub request: String,
    /// The DeviceClass it uses.
    pub class: String,
    /// Devices wanted: a count, or `All`.
    pub wanted: String,
    /// Devices that would fit this request alone (`pool/device`).
    pub candidates: Vec<String>,
    /// Devices that do not fit, each with the first reason found.
    pub rejected: Vec<Rejection>,
}

/// A device rejected for a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    /// `pool/device`.
    pub device: String,
    /// Why.
    pub reason: Reason,
}

/// Why a device does not fit a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Reason {
    /// Allocated exclusively to other claims.
    #[serde(rename_all = "camelCase")]
    InUse {
        /// The claims holding it.
        holders: Vec<String>,
    },
    /// A selector of the DeviceClass is false.
    #[serde(rename_all = "camelCase")]
    ClassSelector {
        /// The class.
        class: String,
        /// Index of the selector.
        index: usize,
        /// The expression.
        expression: String,
    },
    /// A selector of the request is false.
    #[serde(rename_all = "camelCase")]
    RequestSelector {
        /// Index of the selector.
        index: usize,
        /// The expression.
        expression: String,
    },
    /// A shared counter of the pool is exhausted.
    #[serde(rename_all = "camelCase")]
    Counter {
        /// The counter set.
        counter_set: String,
        /// The counter.
        counter: String,
        /// What the device consumes.
        needs: String,
        /// What is left.
        available: String,
        /// Claims holding devices that consume this counter.
        holders: Vec<String>,
    },
    /// The capacity request cannot be met.
    #[serde(rename_all = "camelCase")]
    Capacity {
        /// The capacity name.
        capacity: String,
        /// What the request asked for (absent: the default applies).
        requested: Option<String>,
        /// The amount after requestPolicy rounding.
        consumed: Option<String>,
        /// What is left on the device.
        remaining: String,
        /// Which rule failed.
        detail: String,
        /// Claims holding shares of the device.
        holders: Vec<String>,
    },
    /// An untolerated taint.
    #[serde(rename_all = "camelCase")]
    Taint {
        /// Taint key.
        key: String,
        /// Taint value.
        value: Option<String>,
        /// Taint effect.
        effect: String,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::InUse { holders } => write!(f, "in use by {}", holders.join(", ")),
            Reason::ClassSelector {
                class,
                index,
                expression,
            } => write!(f, "class {class} selector #{index} is false: {expression}"),
            Reason::RequestSelector { index, expression } => {
                write!(f, "request selector #{index} is false: {expression}")
            }
            Reason::Counter {
                counter_set,
                counter,
                needs,
                available,
                holders,
            } => {
                write!(
                    f,
                    "counter {counter_set}/{counter} exhausted: needs {needs}, {available} left"
                )?;
                if !holders.is_empty() {
                    write!(f, "; freeing {} would release it", holders.join(", "))?;
                }
                Ok(())
            }
            Reason::Capacity {
                capacity,
                requested,
                consumed,
                remaining,
                detail,
                holders,
            } => {
                write!(f, "capacity {capacity}: {detail}")?;
                if let Some(r) = requested {
                    write!(f, " (requested {r}")?;
                } else {
                    write!(f, " (not requested")?;
                }
                if let Some(c) = consumed {
                    write!(f, ", consumes {c}")?;
                }
                write!(f, ", {remaining} left)")?;
                if !holders.is_empty() {
                    write!(f, "; shares held by {}", holders.join(", "))?;
                }
                Ok(())
            }
            Reason::Taint { key, value, effect } => match value {
                Some(v) => write!(f, "untolerated taint {key}={v}:{effect}"),
                None => write!(f, "untolerated taint {key}:{effect}"),
            },
        }
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "claim {} does not fit on node {}", self.claim, self.node)?;
        for p in &self.unusable_pools {
            writeln!(f, "  pool {} unusable: {}", p.pool, p.reason)?;
        }
        for r in &self.requests {
            writeln!(
                f,
                "  request {} (class {}, wants {}): {} candidate(s){}",
                r.request,
                r.class,
                r.wanted,
                r.candidates.len(),
                if r.candidates.is_empty() {
                    String::new()
                } else {
                    format!(": {}", r.candidates.join(", "))
                }
            )?;
            for rej in &r.rejected {
                writeln!(f, "    {}: {}", rej.device, rej.reason)?;
            }
        }
        for c in &self.combination {
            writeln!(f, "  {c}")?;
        }
        if !self.suggestions.is_empty() {
            writeln!(f, "  would fit if other claims released devices:")?;
            for s in &self.suggestions {
                writeln!(f, "    request {}: {s}", s.request)?;
            }
        }
        Ok(())
    }
}
