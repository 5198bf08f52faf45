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

impl Reason {
    /// The rank of a reason: what no change of occupancy can help (selectors,
    /// taints) comes first, what other claims hold comes last.
    fn rank(&self) -> u8 {
        match self {
            Reason::ClassSelector { .. } | Reason::RequestSelector { .. } => 0,
            Reason::Taint { .. } => 1,
            Reason::Capacity { .. } => 2,
            Reason::Counter { .. } => 3,
            Reason::InUse { .. } => 4,
        }
    }

    /// The reason without what differs from device to device (the counter
    /// set, amounts left, holders): rejections with the same summary form one
    /// group.
    fn summary(&self) -> String {
        match self {
            Reason::InUse { .. } => "in use by other claims".into(),
            Reason::ClassSelector { .. }
            | Reason::RequestSelector { .. }
            | Reason::Taint { .. } => self.to_string(),
            Reason::Counter { counter, .. } => format!("counter {counter} exhausted"),
            Reason::Capacity {
                capacity, detail, ..
            } => format!("capacity {capacity}: {detail}"),
        }
    }
}

impl Reason {
    /// The claims whose release would help, where the reason has any.
    fn holders(&self) -> &[String] {
        match self {
            Reason::InUse { holders }
            | Reason::Counter { holders, .. }
            | Reason::Capacity { holders, .. } => holders,
            _ => &[],
        }
    }
}

/// The physical GPU of a carve device name (`gpu-3-mig-...` -> `gpu-3`), or
/// the pool for other devices.
fn gpu_of(device: &str) -> &str {
    let (pool, name) = device.rsplit_once('/').unwrap_or(("", device));
    match name.strip_prefix("gpu-") {
        Some(rest) => {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return pool;
            }
            &name[..4 + digits]
        }
        None => pool,
    }
}

/// One line per kind of rejection: the reason, how many devices, on which
/// GPUs; devices listed only in the alternate form.
fn write_groups(f: &mut fmt::Formatter<'_>, rejected: &[Rejection]) -> fmt::Result {
    let mut groups: Vec<(u8, String, Vec<&Rejection>)> = Vec::new();
    for rej in rejected {
        let summary = rej.reason.summary();
        match groups.iter_mut().find(|g| g.1 == summary) {
            Some(g) => g.2.push(rej),
            None => groups.push((rej.reason.rank(), summary, vec![rej])),
        }
    }
    groups.sort_by_key(|g| g.0);
    for (_, summary, members) in &groups {
        let mut per_gpu: Vec<(&str, usize)> = Vec::new();
        for m in members {
            let g = gpu_of(&m.device);
            match per_gpu.iter_mut().find(|p| p.0 == g) {
                Some(p) => p.1 += 1,
                None => per_gpu.push((g, 1)),
            }
        }
        let spread: Vec<String> = per_gpu.iter().map(|(g, n)| format!("{g} {n}")).collect();
        let mut holders: Vec<&str> = Vec::new();
        for h in members.iter().flat_map(|m| m.reason.holders()) {
            if !holders.contains(&h.as_str()) {
                holders.push(h);
            }
        }
        write!(
            f,
            "    {} device(s): {summary} [{}]",
            members.len(),
            spread.join(", ")
        )?;
        if !holders.is_empty() {
            write!(f, "; held by {}", holders.join(", "))?;
        }
        writeln!(f)?;
    }
    Ok(())
}

/// Text form: one line per reason, decisive reasons first, with device
/// counts per GPU; the alternate form (`{:#}`) lists every rejected device
/// with its full reason.
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
            if f.alternate() {
                for rej in &r.rejected {
                    writeln!(f, "    {}: {}", rej.device, rej.reason)?;
                }
            } else {
                write_groups(f, &r.rejected)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rej(device: &str, reason: Reason) -> Rejection {
        Rejection {
            device: device.into(),
            reason,
        }
    }

    #[test]
    fn rejections_are_grouped_decisive_reason_first_with_counts_per_gpu() {
        let selector = Reason::RequestSelector {
            index: 0,
            expression: "x".into(),
        };
        let counter = |set: &str| Reason::Counter {
            counter_set: set.into(),
            counter: "memory-slices".into(),
            needs: "1".into(),
            available: "0".into(),
            holders: vec![],
        };
        let e = Explanation {
            claim: "default/c".into(),
            node: "n".into(),
            unusable_pools: vec![],
            requests: vec![RequestExplanation {
                request: "gpu".into(),
                class: "mig".into(),
                wanted: "1".into(),
                candidates: vec![],
                rejected: vec![
                    rej("n/gpu-0-mig-1g10gb-0", counter("gpu-0-counters")),
                    rej("n/gpu-0-mig-1g10gb-1", counter("gpu-0-counters")),
                    rej("n/gpu-1-mig-1g10gb-0", counter("gpu-1-counters")),
                    rej(
                        "n/gpu-12",
                        Reason::InUse {
                            holders: vec!["default/a".into()],
                        },
                    ),
                    rej("n/gpu-1-mps", selector.clone()),
                ],
            }],
            combination: vec![],
            suggestions: vec![],
        };
        let text = e.to_string();
        let lines: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(
            lines,
            [
                "    1 device(s): request selector #0 is false: x [gpu-1 1]",
                "    3 device(s): counter memory-slices exhausted [gpu-0 2, gpu-1 1]",
                "    1 device(s): in use by other claims [gpu-12 1]; held by default/a",
            ],
            "{text}"
        );
        let all = format!("{e:#}");
        assert!(
            all.contains("    n/gpu-1-mps: request selector #0 is false: x\n"),
            "{all}"
        );
        assert_eq!(all.lines().count(), 2 + 5, "{all}");
    }

    #[test]
    fn gpu_of_reads_carve_names_and_falls_back_to_the_pool() {
        assert_eq!(gpu_of("node/gpu-3-mig-1g10gb-0"), "gpu-3");
        assert_eq!(gpu_of("node/gpu-10"), "gpu-10");
        assert_eq!(gpu_of("pool/other"), "pool");
        assert_eq!(gpu_of("pool/gpu-x"), "pool");
    }
}
