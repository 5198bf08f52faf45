//! What the kube-scheduler's allocator of one release counts, and so how a
//! node must publish its sharing devices for it.
//!
//! The facts, from `k8s.io/dynamic-resource-allocation` (`structured`) of each
//! release:
//!
//! - **Counters of shared devices.** When a scheduling cycle rebuilds the
//!   allocated state from the claims already allocated, 1.34 through 1.36.1
//!   take the counters of a device only when it is in `AllocatedDevices`,
//!   which holds devices allocated whole; shared (multi-allocatable) devices
//!   are in `AllocatedSharedDeviceIDs` and their counters are left out (read
//!   in the sources of 1.34.13 and 1.35.10, the newest of their lines the Go
//!   module proxy serves, and of 1.36.1). From 1.36.2 (and in 1.37.2) the allocator
//!   asks `internal.IsDeviceAllocated`, which counts both. So before 1.36.2 a MIG
//!   partition or a whole GPU can be allocated over a running MPS,
//!   MIG-MPS or time-slice share, and one share over another share's units.
//! - **distinctAttribute.** 1.34's constraint compares the attributes'
//!   pointers, never their values, so it never rejects (fixed in 1.35).
//! - **Capacity of a shared device.** With consumable capacity on, 1.34
//!   checks the capacity of the device at the chosen device's *position in
//!   its request* within the chosen device's slice (`Devices[k]` for the
//!   request's k-th device), not the chosen device (fixed in 1.35, which
//!   passes the device). So it reads another device's capacity and what is
//!   already consumed of it, and when the slice has k devices or fewer it
//!   indexes past the end and panics: a claim for two MPS shares, or for
//!   several whole GPUs, crashes kube-scheduler (its Filter runs under
//!   `HandleCrash`, which re-panics). Run through the upstream allocator of
//!   1.34.13 on carve's slices (`e2e/tests/upstream_allocator.rs`). No
//!   layout avoids it, so carve publishes no share for a 1.34 scheduler,
//!   and the README says to keep `DRAConsumableCapacity` off on one.
//! - **Counters of rejected candidates** (kubernetes/kubernetes#140436):
//!   through 1.36.2 the allocator keeps the counters of a candidate it
//!   rejects on a constraint or a taint, so later candidates of the same
//!   counter set look exhausted and a claim that fits is refused. 1.36.3
//!   (and 1.37.2) roll them back (`deviceRollbackState`).
//!
//! The version-skew policy lets kube-scheduler be up to one minor release
//! older than the API server and never newer, and a node sees only the API
//! server's version, so without an admin's word carve assumes the oldest
//! scheduler that policy allows ([`SchedulerVersion::oldest_for`]).

use std::collections::BTreeMap;
use std::fmt;

/// A kube-scheduler release `1.<minor>[.<patch>]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SchedulerVersion {
    /// Minor version.
    pub minor: u32,
    /// Patch release; `None` when only the minor is known (taken as its
    /// earliest patch where that matters).
    pub patch: Option<u32>,
}

/// Why a scheduler version or a `--shared-gpus` list does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// Not `1.<minor>[.<patch>]`.
    #[error("{given:?} is not a kube-scheduler release like 1.35 or 1.36.2")]
    Version {
        /// The text given.
        given: String,
    },
    /// A `--shared-gpus` entry that is not `INDEX=mps|timeslice|mig-mps:PROFILE`.
    #[error("shared GPU {given:?}: {why}")]
    SharedGpu {
        /// The entry given.
        given: String,
        /// What is wrong with it.
        why: String,
    },
}

impl SchedulerVersion {
    /// `1.<minor>` with its patch release.
    #[must_use]
    pub const fn new(minor: u32, patch: Option<u32>) -> Self {
        Self { minor, patch }
    }

    /// Parse `1.35`, `1.36.2` or `v1.36.2`.
    ///
    /// # Errors
    /// [`SchedulerError::Version`] for anything else (also a major other than 1).
    pub fn parse(s: &str) -> Result<Self, SchedulerError> {
        let bad = || SchedulerError::Version {
            given: s.to_string(),
        };
        let t = s.trim();
        let t = t.strip_prefix('v').unwrap_or(t);
        let parts: Vec<&str> = t.split('.').collect();
        if !(2..=3).contains(&parts.len()) {
            return Err(bad());
        }
        let num = |p: &str| -> Result<u32, SchedulerError> {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            p.parse().map_err(|_| bad())
        };
        if num(parts[0])? != 1 {
            return Err(bad());
        }
        let minor = num(parts[1])?;
        let patch = parts.get(2).map(|p| num(p)).transpose()?;
        Ok(Self { minor, patch })
    }

    /// The oldest kube-scheduler the version-skew policy allows beside an
    /// API server of `1.<apiserver_minor>`: one minor older, its first patch;
    /// never before 1.34.0, the first with `resource.k8s.io/v1` (an older
    /// one cannot read these slices at all).
    #[must_use]
    pub fn oldest_for(apiserver_minor: u32) -> Self {
        Self {
            minor: apiserver_minor.saturating_sub(1).max(34),
            patch: Some(0),
        }
    }

    /// Whether the policy allows this scheduler beside an API server of
    /// `1.<apiserver_minor>`: not newer, at most one minor older.
    #[must_use]
    pub fn allowed_with(self, apiserver_minor: u32) -> bool {
        self.minor <= apiserver_minor && self.minor + 1 >= apiserver_minor
    }

    /// Whether its allocator counts the counters of shared devices already
    /// allocated: from 1.36.2. A 1.36 without its patch is taken as 1.36.0.
    #[must_use]
    pub fn counts_shared_counters(self) -> bool {
        self.minor > 36 || (self.minor == 36 && self.patch.is_some_and(|p| p >= 2))
    }

    /// Whether its allocator enforces `distinctAttribute`: from 1.35.
    #[must_use]
    pub fn enforces_distinct_attribute(self) -> bool {
        self.minor >= 35
    }

    /// Whether it checks a shared device's capacity against the device it
    /// chose: from 1.35 (1.34 reads the device at the chosen one's position
    /// in the request, and panics past the slice's end). carve publishes
    /// shares only for a scheduler that does.
    #[must_use]
    pub fn checks_chosen_device_capacity(self) -> bool {
        self.minor >= 35
    }

    /// Whether its allocator keeps the counters of candidates it rejects
    /// (kubernetes/kubernetes#140436), refusing some claims that fit:
    /// through 1.36.2; a 1.36 without its patch is taken as 1.36.0.
    #[must_use]
    pub fn leaks_rejected_counters(self) -> bool {
        self.minor < 36 || (self.minor == 36 && self.patch.is_none_or(|p| p < 3))
    }
}

impl fmt::Display for SchedulerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.patch {
            Some(p) => write!(f, "1.{}.{p}", self.minor),
            None => write!(f, "1.{}", self.minor),
        }
    }
}

/// What one GPU hosts where shares are published apart
/// ([`ShareLayout::Separate`]): one kind of share, on units no other
/// published device overlaps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedGpu {
    /// MPS on the whole GPU (`gpu-<i>-mps`) and nothing else.
    Mps,
    /// The time-sliced whole GPU (`gpu-<i>-ts`) and nothing else.
    Timeslice,
    /// MPS on MIG instances of one profile, at placements that do not
    /// overlap (as many as fit), and nothing else.
    MigMps {
        /// The profile's name, as `carve models` lists it (`2g.20gb`).
        profile: String,
    },
}

impl fmt::Display for SharedGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mps => f.write_str("mps"),
            Self::Timeslice => f.write_str("timeslice"),
            Self::MigMps { profile } => write!(f, "mig-mps:{profile}"),
        }
    }
}

/// How a node publishes its sharing devices beside its exclusive ones.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ShareLayout {
    /// Every GPU publishes its exclusive devices (whole GPU, MIG placements)
    /// and its sharing devices side by side, all consuming the GPU's
    /// counters: right for a scheduler that counts shared devices' counters
    /// ([`SchedulerVersion::counts_shared_counters`]).
    #[default]
    Mixed,
    /// Only the GPUs listed publish sharing devices, each one kind on
    /// pairwise disjoint units and no exclusive device; every other GPU
    /// publishes only exclusive devices. No published share then overlaps any
    /// other published device, so a scheduler that leaves shares' counters out
    /// cannot place anything over a share. In the 1.34 layout (a slice builder
    /// given shares there; [`Self::for_scheduler`] gives none for 1.34) each
    /// listed GPU has a slice of its own.
    Separate(BTreeMap<u32, SharedGpu>),
}

impl ShareLayout {
    /// The layout a scheduler `v` needs: [`Self::Mixed`] where it counts
    /// shared devices' counters, else [`Self::Separate`] with `shared`; no
    /// share at all (`Separate` with none) for a scheduler that does not
    /// check a share's capacity on the device it chose (1.34).
    #[must_use]
    pub fn for_scheduler(v: SchedulerVersion, shared: &BTreeMap<u32, SharedGpu>) -> Self {
        if !v.checks_chosen_device_capacity() {
            Self::Separate(BTreeMap::new())
        } else if v.counts_shared_counters() {
            Self::Mixed
        } else {
            Self::Separate(shared.clone())
        }
    }
}

/// Parse a `--shared-gpus` list: `INDEX=mps|timeslice|mig-mps:PROFILE`
/// entries separated by commas (empty: none).
///
/// # Errors
/// [`SchedulerError::SharedGpu`] naming the entry: not `INDEX=KIND`, an
/// unknown kind, `mig-mps` without a profile, or an index given twice.
pub fn parse_shared_gpus(s: &str) -> Result<BTreeMap<u32, SharedGpu>, SchedulerError> {
    let mut out = BTreeMap::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| SchedulerError::SharedGpu {
            given: entry.to_string(),
            why: why.to_string(),
        };
        let Some((index, kind)) = entry.split_once('=') else {
            return Err(bad(
                "not INDEX=mps, INDEX=timeslice or INDEX=mig-mps:PROFILE",
            ));
        };
        let index: u32 = index
            .trim()
            .parse()
            .map_err(|_| bad("the GPU index is not a number"))?;
        let kind = match kind.trim() {
            "mps" => SharedGpu::Mps,
            "timeslice" => SharedGpu::Timeslice,
            k => match k.strip_prefix("mig-mps:") {
                Some(p) if !p.trim().is_empty() => SharedGpu::MigMps {
                    profile: p.trim().to_string(),
                },
                _ if k.starts_with("mig-mps") => {
                    return Err(bad(
                        "mig-mps needs the MIG profile of its units: mig-mps:PROFILE (as `carve models` names it, e.g. mig-mps:2g.20gb)",
                    ));
                }
                _ => return Err(bad("the kind is not mps, timeslice or mig-mps:PROFILE")),
            },
        };
        if out.insert(index, kind).is_some() {
            return Err(bad("this GPU index is listed twice"));
        }
    }
    Ok(out)
}

/// A `--shared-gpus` list as [`parse_shared_gpus`] reads it.
#[must_use]
pub fn shared_gpus_string(m: &BTreeMap<u32, SharedGpu>) -> String {
    m.iter()
        .map(|(i, k)| format!("{i}={k}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_say_what_they_count() {
        let v = |s| SchedulerVersion::parse(s).unwrap();
        assert_eq!(v("1.36.2"), SchedulerVersion::new(36, Some(2)));
        assert_eq!(v("v1.35"), SchedulerVersion::new(35, None));
        for bad in ["1", "2.36", "1.x", "1.36.2.1", "", "1.-3", "1.36."] {
            assert!(SchedulerVersion::parse(bad).is_err(), "{bad}");
        }
        assert!(!v("1.34.9").counts_shared_counters());
        assert!(!v("1.35.6").counts_shared_counters());
        assert!(!v("1.36").counts_shared_counters());
        assert!(!v("1.36.1").counts_shared_counters());
        assert!(v("1.36.2").counts_shared_counters());
        assert!(v("1.37").counts_shared_counters());
        assert!(!v("1.34").enforces_distinct_attribute());
        assert!(v("1.35.0").enforces_distinct_attribute());
        assert!(!v("1.34.4").checks_chosen_device_capacity());
        assert!(v("1.36.2").leaks_rejected_counters() && v("1.36").leaks_rejected_counters());
        assert!(!v("1.36.3").leaks_rejected_counters() && !v("1.37").leaks_rejected_counters());
        let one = parse_shared_gpus("1=mps").unwrap();
        assert_eq!(
            ShareLayout::for_scheduler(v("1.34.13"), &one),
            ShareLayout::Separate(BTreeMap::new())
        );
        assert_eq!(
            ShareLayout::for_scheduler(v("1.35.10"), &one),
            ShareLayout::Separate(one.clone())
        );
        assert_eq!(
            ShareLayout::for_scheduler(v("1.36.2"), &one),
            ShareLayout::Mixed
        );
    }

    #[test]
    fn the_oldest_scheduler_the_skew_policy_allows() {
        assert_eq!(
            SchedulerVersion::oldest_for(37),
            SchedulerVersion::new(36, Some(0))
        );
        assert!(!SchedulerVersion::oldest_for(37).counts_shared_counters());
        assert!(SchedulerVersion::oldest_for(38).counts_shared_counters());
        assert_eq!(
            SchedulerVersion::oldest_for(34),
            SchedulerVersion::new(34, Some(0))
        );
        let v = SchedulerVersion::new(36, Some(3));
        assert!(v.allowed_with(36) && v.allowed_with(37));
        assert!(!v.allowed_with(35) && !v.allowed_with(38));
    }

    #[test]
    fn shared_gpu_lists_parse_and_refuse_what_is_wrong() {
        let m = parse_shared_gpus("1=mig-mps:2g.20gb, 3=mps,4=timeslice").unwrap();
        assert_eq!(
            shared_gpus_string(&m),
            "1=mig-mps:2g.20gb,3=mps,4=timeslice"
        );
        assert!(parse_shared_gpus("").unwrap().is_empty());
        for (bad, says) in [
            ("1", "INDEX="),
            ("x=mps", "not a number"),
            ("1=mig", "not mps"),
            ("1=mig-mps", "mig-mps:PROFILE"),
            ("1=mig-mps:", "mig-mps:PROFILE"),
            ("1=mps,1=timeslice", "twice"),
        ] {
            let e = parse_shared_gpus(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
