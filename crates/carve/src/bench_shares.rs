//! `carve bench shares`: what publishing shares apart costs in packing.
//!
//! One node, one fixed-seed sequence of claims (MIG partitions, whole GPUs,
//! MPS, MIG-MPS and time-slice shares), allocated one after another by
//! carve's allocator (the scheduler's semantics, shares' counters counted)
//! on the slices of each layout: shares beside exclusive devices on every
//! GPU (what a scheduler of 1.36.2 or later gets), and shares apart on the
//! GPUs a `--shared-gpus` list names. No claim leaves. The figure is how many
//! claims of each kind get a device, paired per seed against the first
//! layout, with the standard error of the mean over seeds.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Context as _;
use carve_alloc::{AllocError, Allocator, Inputs, Object};
use carve_model::scheduler::{SchedulerVersion, parse_shared_gpus};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};

/// `carve bench shares`.
#[derive(Debug, clap::Args)]
pub struct SharesBench {
    /// The node's GPUs, as `carve slices --gpus`.
    #[arg(long, default_value = "h100-80gb:8", value_parser = crate::parse_gpus_flag)]
    gpus: String,
    /// Claims in each sequence.
    #[arg(long, default_value_t = 120)]
    claims: usize,
    /// Seeds, e.g. `1..20` (both ends included) or `1,5,9`.
    #[arg(long, default_value = "1..10")]
    seeds: String,
    /// Layouts, separated by `;`: `mixed` (shares beside exclusive devices),
    /// or a `--shared-gpus` list (shares apart on those GPUs). The first is
    /// the one the others are paired against.
    #[arg(
        long,
        value_delimiter = ';',
        default_value = "mixed;7=mps;6=mps,7=mig-mps:2g.20gb;5=mps,6=mig-mps:2g.20gb,7=timeslice"
    )]
    layouts: Vec<String>,
}

/// The kinds of claim in a sequence, their weights and requests.
const KINDS: [(&str, u32); 7] = [
    ("mig-1g", 30),
    ("mig-2g", 10),
    ("mig-3g", 10),
    ("whole-gpu", 5),
    ("mps", 25),
    ("mig-mps", 10),
    ("timeslice", 10),
];

fn request(kind: &str) -> serde_json::Value {
    let cel = |e: &str| serde_json::json!([{"cel": {"expression": e}}]);
    let capacity =
        |m: &str, sm: &str| serde_json::json!({"requests": {"memory": m, "multiprocessors": sm}});
    match kind {
        "mig-1g" => {
            serde_json::json!({"deviceClassName": "mig.gpu.carve.dev", "selectors": cel("device.attributes[\"gpu.carve.dev\"].memorySlices == 1 && device.attributes[\"gpu.carve.dev\"].computeSlices == 1 && !device.attributes[\"gpu.carve.dev\"].profile.endsWith(\"+me\")")})
        }
        "mig-2g" => {
            serde_json::json!({"deviceClassName": "mig.gpu.carve.dev", "selectors": cel("device.attributes[\"gpu.carve.dev\"].computeSlices == 2")})
        }
        "mig-3g" => {
            serde_json::json!({"deviceClassName": "mig.gpu.carve.dev", "selectors": cel("device.attributes[\"gpu.carve.dev\"].computeSlices == 3")})
        }
        "whole-gpu" => serde_json::json!({"deviceClassName": "gpu.carve.dev"}),
        "mps" => {
            serde_json::json!({"deviceClassName": "mps.gpu.carve.dev", "capacity": capacity("8Gi", "16")})
        }
        "mig-mps" => {
            serde_json::json!({"deviceClassName": "mig-mps.gpu.carve.dev", "selectors": cel("device.attributes[\"gpu.carve.dev\"].computeSlices == 2"), "capacity": capacity("4Gi", "8")})
        }
        _ => serde_json::json!({"deviceClassName": "timeslice.gpu.carve.dev"}),
    }
}

/// splitmix64: a fixed, seedable sequence.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The claim sequence of `seed`: (kind, claim).
fn sequence(seed: u64, n: usize) -> anyhow::Result<Vec<(&'static str, ResourceClaim)>> {
    let total: u32 = KINDS.iter().map(|(_, w)| w).sum();
    let mut state = seed;
    (0..n)
        .map(|i| {
            let mut pick = u32::try_from(next(&mut state) % u64::from(total))?;
            let kind = KINDS
                .iter()
                .find(|(_, w)| {
                    let hit = pick < *w;
                    pick = pick.saturating_sub(*w);
                    hit
                })
                .map_or("timeslice", |(k, _)| k);
            let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": format!("c{i:03}-{kind}"), "namespace": "bench"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request(kind)}]}},
            }))?;
            Ok((kind, claim))
        })
        .collect()
}

/// Claims placed per kind when `seq` fills a node with `slices`.
fn fill(
    slices: &[k8s_openapi::api::resource::v1::ResourceSlice],
    classes: &[k8s_openapi::api::resource::v1::DeviceClass],
    seq: &[(&'static str, ResourceClaim)],
) -> anyhow::Result<BTreeMap<&'static str, u32>> {
    let node = slices
        .iter()
        .find_map(|s| s.spec.node_name.clone())
        .context("the slices name no node")?;
    let mut inputs = Inputs {
        slices: slices.to_vec(),
        classes: classes.to_vec(),
        claims_allocated: Vec::new(),
    };
    let mut placed: BTreeMap<&'static str, u32> = KINDS.iter().map(|(k, _)| (*k, 0)).collect();
    for (kind, claim) in seq {
        let result = Allocator::new(&inputs)?.allocate(claim, &node);
        match result {
            Ok(allocation) => {
                let mut c = claim.clone();
                c.status = Some(ResourceClaimStatus {
                    allocation: Some(allocation),
                    ..Default::default()
                });
                inputs.claims_allocated.push(c);
                *placed.entry(kind).or_default() += 1;
            }
            Err(AllocError::Unsatisfiable(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(placed)
}

fn mean_se(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// Run it; the report as text.
pub fn run(a: &SharesBench) -> anyhow::Result<String> {
    let seeds = carve_frag::bench::parse_seeds(&a.seeds).context("--seeds")?;
    let classes: Vec<_> = carve_alloc::parse_yaml_documents(
        std::path::Path::new("<built-in deviceclasses.yaml>"),
        crate::explain::DEVICE_CLASSES,
    )?
    .into_iter()
    .filter_map(|o| match o {
        Object::Class(c) => Some(c),
        _ => None,
    })
    .collect();
    // The slices of each layout, on the 1.36 layout (consumable capacity on).
    let mut layouts = Vec::new();
    for l in &a.layouts {
        let shares = if l.trim() == "mixed" {
            crate::shares::ShareArgs {
                scheduler_version: Some(SchedulerVersion::new(36, Some(2))),
                shared_gpus: None,
            }
        } else {
            crate::shares::ShareArgs {
                scheduler_version: Some(SchedulerVersion::new(35, None)),
                shared_gpus: Some(
                    parse_shared_gpus(l).with_context(|| format!("--layouts: {l:?}"))?,
                ),
            }
        };
        let args = crate::slices::SlicesArgs {
            shares,
            gpus_flag: "--gpus",
            ..crate::slices::SlicesArgs::simulated(
                &a.gpus,
                carve_apiserver::KubeVersion {
                    major: 1,
                    minor: 36,
                },
                "bench-node",
            )
        };
        let slices =
            crate::slices::build(&args).with_context(|| format!("the slices of layout {l:?}"))?;
        layouts.push((l.trim().to_string(), slices));
    }
    // placed[layout][seed] = per kind.
    let mut placed: Vec<Vec<BTreeMap<&'static str, u32>>> = vec![Vec::new(); layouts.len()];
    for &seed in &seeds {
        let seq = sequence(seed, a.claims)?;
        for (li, (_, slices)) in layouts.iter().enumerate() {
            placed[li].push(fill(slices, &classes, &seq)?);
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "carve bench shares: {} claims a sequence on {}, {} seed(s) ({}); claims placed (mean over seeds), paired against {:?}",
        a.claims,
        a.gpus,
        seeds.len(),
        a.seeds,
        layouts.first().map_or("", |l| l.0.as_str())
    );
    let kinds: Vec<&str> = KINDS.iter().map(|(k, _)| *k).collect();
    let _ = writeln!(
        out,
        "{:<44} {:>14} {:>14}  {}",
        "layout",
        "placed",
        "vs first",
        kinds.join(" ")
    );
    let total = |m: &BTreeMap<&str, u32>| f64::from(m.values().sum::<u32>());
    for (li, (name, _)) in layouts.iter().enumerate() {
        let totals: Vec<f64> = placed[li].iter().map(total).collect();
        let diffs: Vec<f64> = placed[li]
            .iter()
            .zip(&placed[0])
            .map(|(m, base)| total(m) - total(base))
            .collect();
        let (m, se) = mean_se(&totals);
        let (d, dse) = mean_se(&diffs);
        let per_kind: Vec<String> = kinds
            .iter()
            .map(|k| {
                let v: Vec<f64> = placed[li]
                    .iter()
                    .map(|p| f64::from(p.get(k).copied().unwrap_or(0)))
                    .collect();
                format!("{:.1}", mean_se(&v).0)
            })
            .collect();
        let _ = writeln!(
            out,
            "{:<44} {:>7.1} ± {:<4.1} {:>+7.1} ± {:<4.1}  {}",
            name,
            m,
            se,
            d,
            dse,
            per_kind.join(" ")
        );
    }
    let _ = writeln!(
        out,
        "kinds: {}",
        KINDS
            .iter()
            .map(|(k, w)| format!("{k} {w} %"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_is_fixed_by_its_seed_and_every_kind_is_drawn() {
        let a = sequence(3, 200).unwrap();
        let b = sequence(3, 200).unwrap();
        let names = |s: &[(&'static str, ResourceClaim)]| -> Vec<&'static str> {
            s.iter().map(|(k, _)| *k).collect::<Vec<_>>()
        };
        assert_eq!(names(&a), names(&b));
        assert_ne!(names(&a), names(&sequence(4, 200).unwrap()));
        for (k, _) in KINDS {
            assert!(names(&a).contains(&k), "{k}");
        }
    }

    /// Apart, a kind no GPU hosts gets nothing, the kinds listed get
    /// devices; both layouts place the same sequence.
    #[test]
    fn apart_the_shares_go_only_where_listed() {
        let r = run(&SharesBench {
            gpus: "h100-80gb:4".into(),
            claims: 40,
            seeds: "1".into(),
            layouts: vec!["mixed".into(), "2=mps,3=mig-mps:2g.20gb".into()],
        })
        .unwrap();
        let row = |name: &str| {
            r.lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("no row {name}:\n{r}"))
                .to_string()
        };
        let cells = |l: &str| -> Vec<f64> {
            l.split_whitespace()
                .rev()
                .take(KINDS.len())
                .map(|c| c.parse().unwrap())
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect()
        };
        let mixed = cells(&row("mixed"));
        let apart = cells(&row("2=mps,3=mig-mps:2g.20gb"));
        assert!(mixed.iter().sum::<f64>() > 0.0, "{r}");
        // Time-slicing has no GPU apart; MPS and MIG-MPS have theirs.
        assert_eq!(apart[6], 0.0, "{r}");
        assert!(apart[4] > 0.0 && apart[5] > 0.0, "{r}");
    }
}
