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
//!    rounded up to the smallest profile covering its compute share, and the
//!    profiles are packed onto GPUs at real placements (first fit, largest
//!    first), since profiles that each fit may not fit one GPU together (1g +
//!    7g). The overhead is the larger of granted / requested compute slices and
//!    GPUs used / GPUs the sizes add up to.

use std::collections::BTreeMap;
use std::fmt;

use carve_model::GpuSpec;
use carve_model::geometry::{Instance, Occupancy};

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
    /// The sizes each profile serves (one template per profile).
    pub per_profile: BTreeMap<String, Vec<f64>>,
    /// GPUs the profiles pack onto at real placements.
    pub gpus: usize,
    /// GPUs the sizes add up to (the fewest any sharing could use).
    pub min_gpus: usize,
}

impl MigFit {
    /// The larger of granted / requested compute slices and GPUs used / GPUs
    /// the sizes add up to: what MIG costs over sharing at fine granularity.
    #[must_use]
    pub fn overhead(&self) -> f64 {
        let rounding = if self.requested == 0.0 {
            1.0
        } else {
            self.granted / self.requested
        };
        let packing = self.gpus as f64 / self.min_gpus.max(1) as f64;
        rounding.max(packing)
    }
}

/// Packs instances of the given profiles (positions in `spec.profiles`),
/// largest first, each at the first placement free on the first GPU that has
/// one; returns the number of GPUs used.
fn pack(spec: &GpuSpec, mut profiles: Vec<usize>) -> usize {
    profiles.sort_by_key(|&p| {
        std::cmp::Reverse((
            spec.profiles[p].memory_slices,
            spec.profiles[p].compute_slices,
        ))
    });
    let mut gpus: Vec<Occupancy<'_>> = Vec::new();
    for p in profiles {
        let at = |occ: &Occupancy<'_>| {
            spec.profiles[p]
                .placements
                .iter()
                .map(|pl| Instance {
                    profile: p,
                    start: pl.start,
                })
                .find(|&i| occ.fits(i))
        };
        let placed = gpus
            .iter_mut()
            .find_map(|occ| at(occ).map(|i| (occ, i)))
            .map(|(occ, i)| occ.place(i).is_ok())
            .unwrap_or(false);
        if !placed {
            let mut fresh = Occupancy::new(spec);
            if let Some(i) = at(&fresh) {
                // A profile always fits an empty GPU at one of its placements.
                let _ = fresh.place(i);
            }
            gpus.push(fresh);
        }
    }
    gpus.len()
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
    let mut profiles: Vec<usize> = (0..spec.profiles.len())
        .filter(|&i| !spec.profiles[i].media_extensions)
        .collect();
    profiles.sort_by_key(|&i| {
        (
            spec.profiles[i].compute_slices,
            spec.profiles[i].memory_slices,
        )
    });
    let mut fit = MigFit {
        requested: 0.0,
        granted: 0.0,
        per_profile: BTreeMap::new(),
        gpus: 0,
        min_gpus: 0,
    };
    let mut chosen = Vec::with_capacity(sizes.len());
    for &s in sizes {
        if !(s > 0.0 && s <= 1.0) {
            return Err(AdviseError::BadSize(s));
        }
        let need = s * total;
        let i = *profiles
            .iter()
            .find(|&&i| f64::from(spec.profiles[i].compute_slices) + 1e-9 >= need)
            .ok_or(AdviseError::BadSize(s))?;
        let p = &spec.profiles[i];
        fit.requested += need;
        fit.granted += f64::from(p.compute_slices);
        fit.per_profile.entry(p.name.clone()).or_default().push(s);
        chosen.push(i);
    }
    fit.gpus = pack(spec, chosen);
    fit.min_gpus = (sizes.iter().sum::<f64>() - 1e-9).ceil().max(1.0) as usize;
    Ok(fit)
}

/// The recommended sharing mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// MIG partitions.
    Mig,
    /// CUDA MPS shares with memory and SM limits.
    Mps,
    /// Time-slicing.
    TimeSlice,
    /// Whole GPUs, one per request: every size is a whole GPU.
    Whole,
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
    let sharing = if sizes.iter().all(|&s| s >= 1.0) {
        reasons.push(format!(
            "every request is a whole GPU: claim whole GPUs (DeviceClass gpu.carve.dev), {} of them; nothing is shared, so no tenant meets another, and a 7g MIG instance would give less than the whole GPU",
            sizes.len()
        ));
        Sharing::Whole
    } else if contention.yes() || fault_isolation.yes() {
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
                "the size mix costs {:.0}% extra compute under MIG's fixed profiles; the isolation above is worth it, or group tenants that trust each other on one MIG instance shared through MPS (DeviceClass mig-mps.gpu.carve.dev)",
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
            "no isolation needed and MIG's fixed sizes would cost {:.0}% extra: MPS shares SMs and memory at fine granularity. Its memory limit is applied by the CUDA client (mpsMemoryLimit: client), which a tenant can escape, and its SM limit is a ceiling, not a reservation: share a GPU this way only between tenants that trust each other",
            (overhead - 1.0) * 100.0
        ));
        Sharing::Mps
    };
    let yaml = claim_yaml(spec, sharing, &fit, sizes);
    Ok(Advice {
        sharing,
        reasons,
        fit,
        yaml,
    })
}

/// One ResourceClaimTemplate per size class: per MIG profile, per MPS share
/// size (each tenant gets what its size needs of a whole GPU, rounded up; the
/// class `mps.gpu.carve.dev` holds only whole-GPU MPS devices, so a template
/// never switches a GPU into MIG mode), or one for time-slicing.
fn claim_yaml(spec: &GpuSpec, sharing: Sharing, fit: &MigFit, sizes: &[f64]) -> String {
    let template = |name: &str, serves: &str, body: &str| {
        format!(
            "# for {serves}\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {name}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly:\n{body}"
        )
    };
    let sizes_of = |v: &[f64]| {
        let list: Vec<String> = v.iter().map(|s| format!("{s}")).collect();
        format!("size(s) {}", list.join(", "))
    };
    // Each template selects the `type` its class selects (the class's own
    // selector, said in the claim too), and a size of 1 gets a whole GPU.
    let typed = |kind: &str, more: &str| {
        format!(
            "          selectors:\n          - cel:\n              expression: device.attributes[\"gpu.carve.dev\"].type == \"{kind}\"{more}\n"
        )
    };
    let mut docs = Vec::new();
    let whole: Vec<f64> = sizes.iter().copied().filter(|&s| s >= 1.0).collect();
    if !whole.is_empty() && sharing != Sharing::TimeSlice {
        docs.push(template(
            "whole-gpu",
            &sizes_of(&whole),
            &format!(
                "          deviceClassName: gpu.carve.dev\n{}",
                typed("gpu", "")
            ),
        ));
    }
    match sharing {
        Sharing::Whole => {}
        Sharing::Mig => {
            for (p, served) in &fit.per_profile {
                let served: Vec<f64> = served.iter().copied().filter(|&s| s < 1.0).collect();
                if served.is_empty() {
                    continue;
                }
                docs.push(template(
                    &format!("mig-{}", p.replace('.', "-")),
                    &sizes_of(&served),
                    &format!(
                        "          deviceClassName: mig.gpu.carve.dev\n{}",
                        typed(
                            "mig",
                            &format!(" && device.attributes[\"gpu.carve.dev\"].profile == \"{p}\"")
                        )
                    ),
                ));
            }
        }
        Sharing::Mps => {
            let mut classes: Vec<f64> = sizes.iter().copied().filter(|&s| s < 1.0).collect();
            classes.sort_by(f64::total_cmp);
            classes.dedup();
            for s in classes {
                let mem_gib = ((spec.memory_mib as f64 * s) / 1024.0).ceil();
                let sms = (f64::from(spec.multiprocessors) * s).ceil();
                docs.push(template(
                    &format!("mps-{:.0}pct", s * 100.0),
                    &sizes_of(&[s]),
                    &format!(
                        "          deviceClassName: mps.gpu.carve.dev\n{}          capacity:\n            requests:\n              memory: {mem_gib}Gi\n              multiprocessors: \"{sms}\"\n",
                        typed("mps", "")
                    ),
                ));
            }
        }
        Sharing::TimeSlice => docs.push(template(
            "timeslice",
            "every size (time-slicing has no per-tenant size)",
            &format!(
                "          deviceClassName: timeslice.gpu.carve.dev\n{}",
                typed("timeslice", "")
            ),
        )),
    }
    docs.join("---\n")
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.sharing {
            Sharing::Mig => "MIG partitions",
            Sharing::Mps => "MPS shares with memory and SM limits",
            Sharing::TimeSlice => "time-slicing",
            Sharing::Whole => "whole GPUs",
        };
        writeln!(f, "recommendation: {name}")?;
        for r in &self.reasons {
            writeln!(f, "  - {r}")?;
        }
        if self.sharing == Sharing::Whole {
            return writeln!(
                f,
                "\n# use (one ResourceClaimTemplate per size class):\n{}",
                self.yaml
            );
        }
        write!(
            f,
            "MIG fit: {:.1} compute slices requested, {:.0} granted ({:.2}x);",
            self.fit.requested,
            self.fit.granted,
            self.fit.overhead()
        )?;
        for (p, served) in &self.fit.per_profile {
            write!(f, " {p}×{}", served.len())?;
        }
        write!(
            f,
            "; packed at real placements onto {} GPU(s), the sizes add up to {}",
            self.fit.gpus, self.fit.min_gpus
        )?;
        writeln!(
            f,
            "\n\n# use (one ResourceClaimTemplate per size class):\n{}",
            self.yaml
        )
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
        assert_eq!(f.per_profile.get("1g.10gb"), Some(&vec![0.1]));
        assert_eq!(f.per_profile.get("2g.20gb"), Some(&vec![0.25]));
        assert_eq!(f.per_profile.get("3g.40gb"), Some(&vec![0.4]));
        assert_eq!(f.per_profile.get("4g.40gb"), Some(&vec![0.5]));
        assert_eq!(f.per_profile.get("7g.80gb"), Some(&vec![0.81]));
        assert!((f.granted - 17.0).abs() < 1e-9);
    }

    #[test]
    fn profiles_that_cannot_share_a_gpu_count_as_the_gpus_they_take() {
        // 1g + 7g: each fits, but the 7g takes every memory slice, so two GPUs
        // for what adds up to one.
        let f = mig_fit(&h100(), &[0.1, 0.9]).unwrap();
        assert_eq!((f.gpus, f.min_gpus), (2, 1));
        assert!((f.overhead() - 2.0).abs() < 1e-9, "{}", f.overhead());
        let a = advise(&h100(), Answer::No, Answer::No, &[0.1, 0.9], false).unwrap();
        assert_ne!(a.sharing, Sharing::Mig, "{:?}", a.reasons);
        // 1g + 2g + 3g share one H100 (6 of 7 compute slices, 7 of 8 memory slices).
        let f = mig_fit(&h100(), &[0.1, 0.25, 0.4]).unwrap();
        assert_eq!((f.gpus, f.min_gpus), (1, 1));
    }

    #[test]
    fn every_size_class_gets_a_template_that_covers_it() {
        // MPS: one template per size, each as large as its tenant needs (a
        // template at the mean would leave the 0.3 tenant short).
        let a = advise(&h100(), Answer::No, Answer::No, &[0.1, 0.25, 0.3], false).unwrap();
        assert_eq!(a.sharing, Sharing::Mps);
        assert_eq!(
            a.yaml.matches("kind: ResourceClaimTemplate").count(),
            3,
            "{}",
            a.yaml
        );
        let spec = h100();
        let sms = (f64::from(spec.multiprocessors) * 0.3).ceil();
        let gib = (spec.memory_mib as f64 * 0.3 / 1024.0).ceil();
        assert!(a.yaml.contains("name: mps-30pct"), "{}", a.yaml);
        assert!(
            a.yaml.contains(&format!(
                "memory: {gib}Gi\n              multiprocessors: \"{sms}\""
            )),
            "{}",
            a.yaml
        );
        // MIG: one template per profile, not only the most common one.
        let m = advise(&h100(), Answer::No, Answer::Yes, &[0.1, 0.5], false).unwrap();
        assert_eq!(m.sharing, Sharing::Mig);
        assert!(m.yaml.contains("profile == \"1g.10gb\""), "{}", m.yaml);
        assert!(m.yaml.contains("profile == \"4g.40gb\""), "{}", m.yaml);
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
    fn no_isolation_and_poor_fit_picks_mps_or_timeslice() {
        let a = advise(&h100(), Answer::No, Answer::No, &[0.3, 0.3, 0.6], false).unwrap();
        assert_eq!(a.sharing, Sharing::Mps);
        // No MPS device enforces memory hard (issue 18): the template asks
        // for capacity only and the reason says what the limit is.
        assert!(!a.yaml.contains("\"hard\""), "{}", a.yaml);
        assert!(a.yaml.contains("capacity:"), "{}", a.yaml);
        assert!(
            a.reasons[0].contains("mpsMemoryLimit: client"),
            "{:?}",
            a.reasons
        );
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
    fn whole_gpu_sizes_get_whole_gpus_and_every_template_its_type() {
        let a = advise(
            &h100(),
            Answer::Unknown,
            Answer::Unknown,
            &[1.0, 1.0],
            false,
        )
        .unwrap();
        assert_eq!(a.sharing, Sharing::Whole, "{:?}", a.reasons);
        assert!(
            a.yaml.contains("deviceClassName: gpu.carve.dev"),
            "{}",
            a.yaml
        );
        assert!(!a.yaml.contains("7g"), "{}", a.yaml);
        // A whole-GPU size beside fractional ones: its own whole-GPU template.
        let m = advise(&h100(), Answer::No, Answer::Yes, &[0.1, 1.0], false).unwrap();
        assert_eq!(m.sharing, Sharing::Mig);
        assert!(m.yaml.contains("name: whole-gpu"), "{}", m.yaml);
        assert!(!m.yaml.contains("7g.80gb"), "{}", m.yaml);
        for (sizes, bursty, kind) in [
            (&[0.1, 0.5][..], false, "mig"),
            (&[0.3, 0.3, 0.6][..], false, "mps"),
            (&[0.3, 0.3, 0.6][..], true, "timeslice"),
            (&[1.0][..], false, "gpu"),
        ] {
            let iso = if kind == "mig" {
                Answer::Yes
            } else {
                Answer::No
            };
            let a = advise(&h100(), Answer::No, iso, sizes, bursty).unwrap();
            let want = format!("device.attributes[\"gpu.carve.dev\"].type == \"{kind}\"");
            assert_eq!(
                a.yaml.matches(&want).count(),
                a.yaml.matches("kind: ResourceClaimTemplate").count(),
                "{kind}: {}",
                a.yaml
            );
        }
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
