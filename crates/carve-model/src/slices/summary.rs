//! A per-GPU digest of published slices, for the CLI's table view.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use crate::names::DeviceName;

/// One GPU's counter set and the devices that consume it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuSummary {
    /// GPU index, from the counter set name `gpu-<i>-counters` or the device names.
    pub gpu: Option<u32>,
    /// Counter set name; `None` for devices that consume no counters (GPUs
    /// without MIG).
    pub counter_set: Option<String>,
    /// Counter name → quantity as published.
    pub counters: BTreeMap<String, String>,
    /// Profile (`1g.10gb`; `gpu` for a whole GPU) → devices that consume this set.
    pub devices: BTreeMap<String, usize>,
}

fn kind_of(d: &Device) -> String {
    let attr = |k: &str| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get(k))
            .and_then(|a| a.string.clone())
    };
    attr("profile")
        .or_else(|| attr("type"))
        .unwrap_or_else(|| d.name.clone())
}

fn gpu_of_set(name: &str) -> Option<u32> {
    name.strip_prefix("gpu-")?
        .strip_suffix("-counters")?
        .parse()
        .ok()
}

/// Summaries of every counter set in `slices`, plus one per GPU for devices that
/// consume no counters; ordered by GPU index, then counter set name.
#[must_use]
pub fn summarize(slices: &[ResourceSlice]) -> Vec<GpuSummary> {
    let mut by_set: BTreeMap<String, GpuSummary> = BTreeMap::new();
    let mut plain: BTreeMap<Option<u32>, GpuSummary> = BTreeMap::new();
    for s in slices {
        for set in s.spec.shared_counters.iter().flatten() {
            let e = by_set.entry(set.name.clone()).or_default();
            e.gpu = gpu_of_set(&set.name);
            e.counter_set = Some(set.name.clone());
            e.counters = set
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), v.value.0.clone()))
                .collect();
        }
    }
    for s in slices {
        for d in s.spec.devices.iter().flatten() {
            let consumes = d.consumes_counters.as_deref().unwrap_or(&[]);
            let gpu = d.name.parse::<DeviceName>().ok().map(|n| n.gpu());
            if consumes.is_empty() {
                let e = plain.entry(gpu).or_default();
                e.gpu = gpu;
                *e.devices.entry(kind_of(d)).or_default() += 1;
            }
            for cc in consumes {
                let e = by_set.entry(cc.counter_set.clone()).or_default();
                e.counter_set = Some(cc.counter_set.clone());
                e.gpu = e.gpu.or(gpu_of_set(&cc.counter_set)).or(gpu);
                *e.devices.entry(kind_of(d)).or_default() += 1;
            }
        }
    }
    let mut out: Vec<GpuSummary> = by_set.into_values().chain(plain.into_values()).collect();
    out.sort_by(|a, b| (a.gpu, &a.counter_set).cmp(&(b.gpu, &b.counter_set)));
    out
}
