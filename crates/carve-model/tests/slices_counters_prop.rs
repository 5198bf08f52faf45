//! The counter model equals the hardware model: a set of MIG devices of one GPU
//! fits the GPU's counter set exactly when it is a valid layout
//! (`Occupancy::with` succeeds). Proven exhaustively per model, and by proptest
//! through the public `consumption_fits`.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use carve_model::geometry::{Instance, Occupancy, layouts};
use carve_model::slices::{
    KubeLayout, NodeGpu, SliceOptions, build_slices, consumption_fits, parse_quantity,
    simulated_node,
};
use carve_model::{DeviceName, GpuSpec, MODELS};
use k8s_openapi::api::resource::v1::{CounterSet, Device};
use proptest::prelude::*;

struct Fixture {
    key: &'static str,
    spec: GpuSpec,
    set: CounterSet,
    /// MIG devices with their instance.
    migs: Vec<(Instance, Device)>,
}

fn fixtures() -> &'static [Fixture] {
    static F: OnceLock<Vec<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        MODELS
            .iter()
            .filter(|m| m.spec().mig_capable)
            .map(|m| {
                let gpus: Vec<NodeGpu> = simulated_node(m.key, 1)
                    .unwrap()
                    .into_iter()
                    .map(NodeGpu::dynamic)
                    .collect();
                let spec = gpus[0].gpu.spec.clone();
                let slices =
                    build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)).unwrap();
                let set = slices[0].spec.shared_counters.as_ref().unwrap()[0].clone();
                let migs = slices
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .filter_map(|d| {
                        let (profile, start) =
                            d.name.parse::<DeviceName>().unwrap().mig_placement()?;
                        let profile = spec
                            .profiles
                            .iter()
                            .position(|p| p.name == profile)
                            .unwrap();
                        Some((Instance { profile, start }, d.clone()))
                    })
                    .collect();
                Fixture {
                    key: m.key,
                    spec,
                    set,
                    migs,
                }
            })
            .collect()
    })
}

/// Every non-empty set of MIG devices whose summed consumption fits the counter
/// set, found by depth-first search with integer counters.
fn fitting_sets(f: &Fixture) -> BTreeSet<Vec<Instance>> {
    let names: Vec<&String> = f.set.counters.keys().collect();
    let cap: Vec<i128> = f
        .set
        .counters
        .values()
        .map(|c| parse_quantity(&c.value.0).unwrap().milli())
        .collect();
    let cost: Vec<Vec<i128>> = f
        .migs
        .iter()
        .map(|(_, d)| {
            let cc = &d.consumes_counters.as_ref().unwrap()[0];
            assert_eq!(cc.counter_set, f.set.name);
            names
                .iter()
                .map(|n| {
                    cc.counters
                        .get(*n)
                        .map_or(0, |c| parse_quantity(&c.value.0).unwrap().milli())
                })
                .collect()
        })
        .collect();
    let mut out = BTreeSet::new();
    let mut used = vec![0i128; cap.len()];
    let mut chosen = Vec::new();
    fn dfs(
        k: usize,
        f: &Fixture,
        cap: &[i128],
        cost: &[Vec<i128>],
        used: &mut Vec<i128>,
        chosen: &mut Vec<Instance>,
        out: &mut BTreeSet<Vec<Instance>>,
    ) {
        for j in k..cost.len() {
            if (0..cap.len()).all(|c| used[c] + cost[j][c] <= cap[c]) {
                (0..cap.len()).for_each(|c| used[c] += cost[j][c]);
                chosen.push(f.migs[j].0);
                let mut l = chosen.clone();
                l.sort();
                out.insert(l);
                dfs(j + 1, f, cap, cost, used, chosen, out);
                chosen.pop();
                (0..cap.len()).for_each(|c| used[c] -= cost[j][c]);
            }
        }
    }
    dfs(0, f, &cap, &cost, &mut used, &mut chosen, &mut out);
    out
}

#[test]
fn fitting_sets_are_exactly_the_hardware_layouts() {
    for f in fixtures() {
        let hw: BTreeSet<Vec<Instance>> = layouts(&f.spec).into_iter().collect();
        let fit = fitting_sets(f);
        assert!(!hw.is_empty());
        let extra: Vec<_> = fit.difference(&hw).take(3).collect();
        let missing: Vec<_> = hw.difference(&fit).take(3).collect();
        assert!(
            extra.is_empty(),
            "{}: counters allow non-layouts {extra:?}",
            f.key
        );
        assert!(
            missing.is_empty(),
            "{}: counters forbid layouts {missing:?}",
            f.key
        );
    }
}

fn model_and_subset() -> impl Strategy<Value = (usize, Vec<usize>)> {
    (0..fixtures().len()).prop_flat_map(|m| {
        let n = fixtures()[m].migs.len();
        (
            Just(m),
            proptest::sample::subsequence((0..n).collect::<Vec<_>>(), 0..=8.min(n)),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn fits_counters_iff_valid_layout((m, picks) in model_and_subset()) {
        let f = &fixtures()[m];
        let devices: Vec<&Device> = picks.iter().map(|&k| &f.migs[k].1).collect();
        let instances: Vec<Instance> = picks.iter().map(|&k| f.migs[k].0).collect();
        let fits = consumption_fits(&f.set, &devices).unwrap();
        let valid = Occupancy::with(&f.spec, &instances).is_ok();
        prop_assert_eq!(fits, valid, "{}: {:?}", f.key, instances);
    }
}
