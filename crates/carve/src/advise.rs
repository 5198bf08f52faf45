//! `carve advise`: the sharing trade-off as three questions, answered with a
//! recommendation (MIG, MPS with an enforcement level, or time-slicing), the
//! reason, and the YAML to use.
//!
//! 1. Do the co-located workloads compete for L2 cache / memory bandwidth? Only
//!    MIG partitions those; MPS and time-slicing never do.
//! 2. May one tenant's fatal GPU fault kill another tenant's process? Under MPS a
//!    fatal fault reaches every client of the server; under time-slicing contexts
//!    are isolated but share the GPU's time; MIG isolates faults per instance.
//! 3. Does the request-size mix fit the fixed MIG profiles? Computed: each size is
//!    rounded up to the smallest profile covering its compute share; the overhead
//!    is granted / requested compute slices.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use carve_model::GpuSpec;

/// An answer to a yes/no question; `Unknown` is treated as the safe answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Answer {
    /// Yes.
    Yes,
    /// No.
    No,
    /// Not known: treated as yes (the conservative side).
    Unknown,
}

impl Answer {
    fn yes(self) -> bool {
        !matches!(self, Self::No)
    }
}

/// How the request sizes map onto MIG profiles.
#[derive(Clone, Debug, PartialEq)]
pub struct MigFit {
    /// Compute slices requested (sum of size × compute slices).
    pub requested: f64,
    /// Compute slices granted after rounding up to profiles.
    pub granted: f64,
    /// Requests per profile.
    pub per_profile: BTreeMap<String, usize>,
}

impl MigFit {
    /// granted / requested.
    #[must_use]
    pub fn overhead(&self) -> f64 {
        if self.requested == 0.0 {
            1.0
        } else {
            self.granted / self.requested
        }
    }

    /// The profile most requests map to.
    #[must_use]
    pub fn most_common(&self) -> Option<&str> {
        self.per_profile
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(p, _)| p.as_str())
    }
}

/// What is wrong with the advisor's input.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdviseError {
    /// A size is not in (0, 1].
    #[error("request size {0} is not a fraction of one GPU in (0, 1]")]
    BadSize(f64),
    /// No sizes.
    #[error("no request sizes given: pass --sizes 0.25,0.5 or --trace FILE")]
    NoSizes,
    /// The GPU model has no MIG profiles.
    #[error("GPU {0} is not MIG-capable")]
    NotMig(String),
}

/// Map each size to the smallest non-media profile whose compute share covers it.
///
/// # Errors
/// A size outside (0, 1], no sizes, or a GPU without MIG.
pub fn mig_fit(spec: &GpuSpec, sizes: &[f64]) -> Result<MigFit, AdviseError> {
    if sizes.is_empty() {
        return Err(AdviseError::NoSizes);
    }
    if !spec.mig_capable {
        return Err(AdviseError::NotMig(spec.product_name.clone()));
    }
    let total = f64::from(spec.compute_slices);
    let mut profiles: Vec<_> = spec
        .profiles
        .iter()
        .filter(|p| !p.media_extensions)
        .collect();
    profiles.sort_by_key(|p| (p.compute_slices, p.memory_slices));
    let mut fit = MigFit {
        requested: 0.0,
        granted: 0.0,
        per_profile: BTreeMap::new(),
    };
    for &s in sizes {
        if !(s > 0.0 && s <= 1.0) {
            return Err(AdviseError::BadSize(s));
        }
        let need = s * total;
        let p = profiles
            .iter()
            .find(|p| f64::from(p.compute_slices) + 1e-9 >= need)
            .ok_or(AdviseError::BadSize(s))?;
        fit.requested += need;
        fit.granted += f64::from(p.compute_slices);
        *fit.per_profile.entry(p.name.clone()).or_default() += 1;
    }
    Ok(fit)
}

/// The recommended sharing mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// MIG partitions.
    Mig,
    /// CUDA MPS with hard (cgroup-enforced) memory limits.
    MpsHard,
    /// Time-slicing.
    TimeSlice,
}

/// The advisor's answer.
#[derive(Clone, Debug)]
pub struct Advice {
    /// What to use.
    pub sharing: Sharing,
    /// Why, one line each.
    pub reasons: Vec<String>,
    /// The MIG fit that informed it.
    pub fit: MigFit,
    /// A DeviceClass-referencing ResourceClaimTemplate to use.
    pub yaml: String,
}

/// Overhead above which MIG's fixed sizes waste too much for workloads that do
/// not need its isolation.
pub const MIG_OVERHEAD_LIMIT: f64 = 1.15;

/// Answer the three questions.
///
/// # Errors
/// Bad sizes (see [`mig_fit`]).
pub fn advise(
    spec: &GpuSpec,
    contention: Answer,
    fault_isolation: Answer,
    sizes: &[f64],
    bursty: bool,
) -> Result<Advice, AdviseError> {
    let fit = mig_fit(spec, sizes)?;
    let mut reasons = Vec::new();
    let overhead = fit.overhead();
    let sharing = if contention.yes() || fault_isolation.yes() {
        if contention.yes() {
            reasons.push(format!(
                "workloads compete for L2/memory bandwidth{}: only MIG partitions them (MPS and time-slicing never do)",
                if contention == Answer::Unknown { " (unknown, assumed)" } else { "" }
            ));
        }
        if fault_isolation.yes() {
            reasons.push(format!(
                "a fatal fault must not cross tenants{}: MIG isolates faults per instance; under MPS a fatal fault reaches every client of the server",
                if fault_isolation == Answer::Unknown { " (unknown, assumed)" } else { "" }
            ));
        }
        if overhead > MIG_OVERHEAD_LIMIT {
            reasons.push(format!(
                "the size mix costs {:.0}% extra compute under MIG's fixed profiles; the isolation above is worth it, or group tenants that trust each other on one MIG instance shared through MPS",
                (overhead - 1.0) * 100.0
            ));
        }
        Sharing::Mig
    } else if overhead <= MIG_OVERHEAD_LIMIT {
        reasons.push(format!(
            "the size mix fits MIG's profiles with {:.0}% overhead: MIG's isolation comes almost free",
            (overhead - 1.0) * 100.0
        ));
        Sharing::Mig
    } else if bursty {
        reasons.push("bursty or dev/test workloads without isolation needs: time-slicing shares the whole GPU over time, with no memory or fault isolation".into());
        Sharing::TimeSlice
    } else {
        reasons.push(format!(
            "no isolation needed and MIG's fixed sizes would cost {:.0}% extra: MPS shares SMs and memory at fine granularity; demand hard memory limits so a tenant cannot exceed its share",
            (overhead - 1.0) * 100.0
        ));
        Sharing::MpsHard
    };
    let yaml = claim_yaml(spec, sharing, &fit, sizes);
    Ok(Advice {
        sharing,
        reasons,
        fit,
        yaml,
    })
}

fn claim_yaml(spec: &GpuSpec, sharing: Sharing, fit: &MigFit, sizes: &[f64]) -> String {
    let mut y = String::from(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: gpu-share\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly:\n",
    );
    match sharing {
        Sharing::Mig => {
            let p = fit.most_common().unwrap_or("1g.10gb");
            let _ = write!(
                y,
                "          deviceClassName: mig.gpu.carve.dev\n          selectors:\n          - cel:\n              expression: device.attributes[\"gpu.carve.dev\"].profile == \"{p}\"\n"
            );
        }
        Sharing::MpsHard => {
            let mean = sizes.iter().sum::<f64>() / sizes.len().max(1) as f64;
            let mem_gib = ((spec.memory_mib as f64 * mean) / 1024.0).ceil();
            let sms = (f64::from(spec.multiprocessors) * mean).ceil();
            let _ = write!(
                y,
                "          deviceClassName: mps.gpu.carve.dev\n          selectors:\n          - cel:\n              expression: device.attributes[\"gpu.carve.dev\"].mpsMemoryLimit == \"hard\"\n          capacity:\n            requests:\n              memory: {mem_gib}Gi\n              multiprocessors: \"{sms}\"\n"
            );
        }
        Sharing::TimeSlice => y.push_str("          deviceClassName: timeslice.gpu.carve.dev\n"),
    }
    y
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.sharing {
            Sharing::Mig => "MIG partitions",
            Sharing::MpsHard => "MPS with hard memory limits",
            Sharing::TimeSlice => "time-slicing",
        };
        writeln!(f, "recommendation: {name}")?;
        for r in &self.reasons {
            writeln!(f, "  - {r}")?;
        }
        write!(
            f,
            "MIG fit: {:.1} compute slices requested, {:.0} granted ({:.2}x);",
            self.fit.requested,
            self.fit.granted,
            self.fit.overhead()
        )?;
        for (p, n) in &self.fit.per_profile {
            write!(f, " {p}×{n}")?;
        }
        writeln!(f, "\n\n# use:\n{}", self.yaml)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::GpuModel;

    fn h100() -> GpuSpec {
        GpuModel::find("h100").unwrap().spec()
    }

    #[test]
    fn sizes_map_to_smallest_covering_profile() {
        let f = mig_fit(&h100(), &[0.1, 0.25, 0.4, 0.5, 0.81]).unwrap();
        assert_eq!(f.per_profile.get("1g.10gb"), Some(&1));
        assert_eq!(f.per_profile.get("2g.20gb"), Some(&1));
        assert_eq!(f.per_profile.get("3g.40gb"), Some(&1));
        assert_eq!(f.per_profile.get("4g.40gb"), Some(&1));
        assert_eq!(f.per_profile.get("7g.80gb"), Some(&1));
        assert!((f.granted - 17.0).abs() < 1e-9);
    }

    #[test]
    fn isolation_needs_pick_mig_even_when_wasteful() {
        let a = advise(&h100(), Answer::No, Answer::Yes, &[0.3, 0.3], false).unwrap();
        assert_eq!(a.sharing, Sharing::Mig);
        assert!(a.reasons.iter().any(|r| r.contains("fatal fault")));
        assert!(a.yaml.contains("3g.40gb"));
    }

    #[test]
    fn unknown_is_treated_as_yes() {
        let a = advise(&h100(), Answer::Unknown, Answer::No, &[0.3], false).unwrap();
        assert_eq!(a.sharing, Sharing::Mig);
        assert!(a.reasons[0].contains("assumed"));
    }

    #[test]
    fn no_isolation_and_poor_fit_picks_mps_hard_or_timeslice() {
        let a = advise(&h100(), Answer::No, Answer::No, &[0.3, 0.3, 0.6], false).unwrap();
        assert_eq!(a.sharing, Sharing::MpsHard);
        assert!(a.yaml.contains("mpsMemoryLimit == \"hard\""));
        let t = advise(&h100(), Answer::No, Answer::No, &[0.3, 0.3, 0.6], true).unwrap();
        assert_eq!(t.sharing, Sharing::TimeSlice);
    }

    #[test]
    fn good_fit_picks_mig_without_isolation_needs() {
        let sizes = [1.0 / 7.0, 2.0 / 7.0, 3.0 / 7.0];
        let a = advise(&h100(), Answer::No, Answer::No, &sizes, false).unwrap();
        assert_eq!(a.sharing, Sharing::Mig);
    }

    #[test]
    fn bad_sizes_are_named() {
        assert_eq!(
            mig_fit(&h100(), &[1.5]).unwrap_err(),
            AdviseError::BadSize(1.5)
        );
        assert_eq!(mig_fit(&h100(), &[]).unwrap_err(), AdviseError::NoSizes);
        let l4 = GpuModel::find("l4").unwrap().spec();
        assert!(matches!(mig_fit(&l4, &[0.5]), Err(AdviseError::NotMig(_))));
    }
}
