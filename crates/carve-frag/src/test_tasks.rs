//! Tasks and profiles for the unit tests of the per-node reference
//! ([`crate::optimum`]) and the online optimum ([`crate::online`]).

use carve_model::{GpuModel, GpuSpec};

use crate::mapping::Demand;

pub(crate) fn h100() -> GpuSpec {
    GpuModel::find("h100-80gb").unwrap().spec()
}

pub(crate) fn pidx(s: &GpuSpec, name: &str) -> usize {
    s.profiles.iter().position(|p| p.name == name).unwrap()
}

/// The H100's profiles the figures track, smallest first.
pub(crate) fn tracked(s: &GpuSpec) -> Vec<usize> {
    ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
        .iter()
        .map(|n| pidx(s, n))
        .collect()
}

/// `count` instances of profile `name`, with `cpu_milli` of CPU.
pub(crate) fn task(s: &GpuSpec, name: &str, count: u32, cpu_milli: u64) -> Demand {
    let p = pidx(s, name);
    Demand {
        cpu_milli,
        memory_mib: 1,
        profile: Some(p),
        count,
        compute_slices: count * u32::from(s.profiles[p].compute_slices),
        memory_slices: count * u32::from(s.profiles[p].memory_slices),
        requested_milli: 1000,
        class: 0,
        models: u64::MAX,
    }
}
