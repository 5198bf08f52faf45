//! Probes captured on real GPUs with `carve nvml-probe` (read-only: nothing on
//! the GPU changed), kept under `tests/fixtures/hardware/` next to the
//! `nvidia-smi mig -lgip`/`-lgipp` output of the same machine. The built-in
//! model tables (the simulator's fixtures) must agree with what NVML reported,
//! and what the plugin would publish from such an inventory must validate.

use std::collections::BTreeMap;
use std::path::PathBuf;

use carve_model::models::MODELS;
use carve_model::slices::{KubeLayout, NodeGpu, SliceOptions, build_slices};
use carve_model::{DeviceName, GpuSpec, ProfileToken};
use carve_nvml::Probe;

fn captures() -> Vec<(PathBuf, Probe)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hardware");
    let mut out: Vec<(PathBuf, Probe)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let probe =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, probe)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no capture under {}", dir.display());
    out
}

/// Profiles in NVML index order, with the tables' `inferred` marks cleared.
fn comparable(mut s: GpuSpec) -> GpuSpec {
    s.profiles.sort_by_key(|p| p.index);
    for p in &mut s.profiles {
        p.inferred = false;
    }
    s
}

#[test]
fn built_in_tables_agree_with_real_hardware() {
    for (path, probe) in captures() {
        for g in &probe.gpus {
            let real = g.info.spec(g.profiles.clone());
            real.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let model = MODELS
                .iter()
                .find(|m| {
                    let s = m.spec();
                    s.product_name == real.product_name && s.memory_mib == real.memory_mib
                })
                .unwrap_or_else(|| {
                    panic!(
                        "{}: no built-in model is {:?} with {} MiB",
                        path.display(),
                        real.product_name,
                        real.memory_mib
                    )
                });
            let table = model.spec();
            // A captured model's values are primary now: the table must not
            // call them inferred.
            for p in &table.profiles {
                assert!(
                    !p.inferred,
                    "{}: {} {} is marked inferred, but {} has it from NVML",
                    model.key,
                    p.name,
                    p.id,
                    path.display()
                );
            }
            assert_eq!(
                comparable(table),
                comparable(real),
                "{} against {}",
                model.key,
                path.display()
            );
        }
    }
}

#[test]
fn a_captured_inventory_publishes_every_placement_and_validates() {
    for (path, probe) in captures() {
        let gpus: Vec<NodeGpu> = probe
            .gpus
            .iter()
            .map(|g| NodeGpu::dynamic(g.info.physical(g.info.spec(g.profiles.clone()))))
            .collect();
        for layout in [KubeLayout::V134, KubeLayout::V135Plus] {
            // build_slices validates every slice it returns.
            let slices = build_slices(&gpus, &SliceOptions::new("node-a", layout))
                .unwrap_or_else(|e| panic!("{} {layout:?}: {e}", path.display()));
            let mut per_profile: BTreeMap<(u32, ProfileToken), usize> = BTreeMap::new();
            let mut whole = 0;
            for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
                match d.name.parse::<DeviceName>().unwrap() {
                    DeviceName::Mig { gpu, profile, .. } => {
                        *per_profile.entry((gpu, profile)).or_default() += 1;
                    }
                    DeviceName::Gpu { .. } => whole += 1,
                    other => panic!("unexpected device {other:?}"),
                }
            }
            assert_eq!(whole, probe.gpus.len(), "{}", path.display());
            for g in &probe.gpus {
                for p in &g.profiles {
                    let token = ProfileToken::from_profile_name(&p.name).unwrap();
                    assert_eq!(
                        per_profile.get(&(g.info.index, token)),
                        Some(&p.placements.len()),
                        "{} GPU {} {}",
                        path.display(),
                        g.info.index,
                        p.name
                    );
                }
            }
        }
    }
}
