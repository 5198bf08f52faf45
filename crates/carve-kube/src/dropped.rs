//! Fields the API server drops without an error while a feature gate is off.
//!
//! The `resource.k8s.io` registry strategies clear a gated field on create,
//! and on update unless the stored object already uses it
//! (`pkg/registry/resource/resourceslice/strategy.go`, `dropDisabledFields`:
//! `dropDisabledDRADeviceTaintsFields` clears every device's `taints`,
//! `dropDisabledDRAPartitionableDevicesFields` clears `sharedCounters`,
//! `perDeviceNodeSelection` and the devices' `consumesCounters` and node
//! selection; with DRAConsumableCapacity off the devices'
//! `allowMultipleAllocations` goes, and with it the capacities'
//! `requestPolicy` (a field of the same gate)). The write succeeds and the
//! answer is the stored object, so the only way to notice is to compare what
//! was sent with what came back: [`dropped_fields`].
//!
//! The 1.34 and 1.35 defaults have all three gates off (alpha);
//! DRAPartitionableDevices, DRAConsumableCapacity and DRADeviceTaints are
//! beta and on by default from 1.36 (dra-api.md A.8).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use crate::publish::dropped_counter_fields;

/// A feature gate whose fields the API server drops while it is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FeatureGate {
    /// `DRAPartitionableDevices`: `sharedCounters`, `consumesCounters`.
    PartitionableDevices,
    /// `DRADeviceTaints`: device `taints`.
    DeviceTaints,
    /// `DRAConsumableCapacity`: `allowMultipleAllocations`, capacity
    /// `requestPolicy`; in claims `shareID` and `consumedCapacity`.
    ConsumableCapacity,
}

impl FeatureGate {
    /// The gate's name as `--feature-gates` spells it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::PartitionableDevices => "DRAPartitionableDevices",
            Self::DeviceTaints => "DRADeviceTaints",
            Self::ConsumableCapacity => "DRAConsumableCapacity",
        }
    }

    /// What publishing without the gate would mean, for the error message.
    #[must_use]
    pub fn consequence(self) -> &'static str {
        match self {
            Self::PartitionableDevices => "without it MIG partitions cannot be published safely",
            Self::DeviceTaints => {
                "without it unhealthy GPUs would stay schedulable (carve's health taints are lost)"
            }
            Self::ConsumableCapacity => {
                "without it MPS and time-slice devices would be published as exclusive devices"
            }
        }
    }
}

impl fmt::Display for FeatureGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Fields of one gate that a write lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The gate that is off.
    pub gate: FeatureGate,
    /// What was dropped, e.g. `taints of 3 devices (first: gpu-0)`.
    pub what: String,
}

fn by_name(s: &ResourceSlice) -> BTreeMap<&str, &Device> {
    s.spec
        .devices
        .iter()
        .flatten()
        .map(|d| (d.name.as_str(), d))
        .collect()
}

/// Devices of `sent` that had `has` and whose stored copy lacks it.
fn lost<'a>(
    sent: &'a ResourceSlice,
    stored: &BTreeMap<&str, &Device>,
    has: impl Fn(&Device) -> bool,
) -> Vec<&'a str> {
    sent.spec
        .devices
        .iter()
        .flatten()
        .filter(|d| has(d))
        .filter(|d| stored.get(d.name.as_str()).is_some_and(|s| !has(s)))
        .map(|d| d.name.as_str())
        .collect()
}

fn describe(field: &str, devices: &[&str]) -> Option<String> {
    devices
        .first()
        .map(|first| format!("{field} of {} devices (first: {first})", devices.len()))
}

/// The gated fields of `sent` that the stored object (the API server's
/// answer to the write) lacks, one entry per gate, in [`FeatureGate`] order.
/// Empty when nothing was dropped.
#[must_use]
pub fn dropped_fields(sent: &ResourceSlice, stored: &ResourceSlice) -> Vec<Dropped> {
    let mut out = Vec::new();
    if let Some(what) = dropped_counter_fields(sent, stored) {
        out.push(Dropped {
            gate: FeatureGate::PartitionableDevices,
            what,
        });
    }
    let stored_devices = by_name(stored);
    let tainted = |d: &Device| d.taints.as_ref().is_some_and(|t| !t.is_empty());
    if let Some(what) = describe("taints", &lost(sent, &stored_devices, tainted)) {
        out.push(Dropped {
            gate: FeatureGate::DeviceTaints,
            what,
        });
    }
    let multi = |d: &Device| d.allow_multiple_allocations == Some(true);
    let policies = |d: &Device| {
        d.capacity
            .iter()
            .flatten()
            .any(|(_, c)| c.request_policy.is_some())
    };
    let sharing: Vec<String> = [
        describe(
            "allowMultipleAllocations",
            &lost(sent, &stored_devices, multi),
        ),
        describe(
            "capacity requestPolicy",
            &lost(sent, &stored_devices, policies),
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !sharing.is_empty() {
        out.push(Dropped {
            gate: FeatureGate::ConsumableCapacity,
            what: sharing.join(" and "),
        });
    }
    out
}

/// [`crate::PublishError::FieldsDropped`] for the first gate (other than
/// DRAPartitionableDevices, which has its own error) whose fields a write
/// lost; logged once here.
pub(crate) fn check(
    verb: crate::Verb,
    sent: &ResourceSlice,
    stored: &ResourceSlice,
) -> Result<(), crate::PublishError> {
    let Some(d) = dropped_fields(sent, stored)
        .into_iter()
        .find(|d| d.gate != FeatureGate::PartitionableDevices)
    else {
        return Ok(());
    };
    let slice = sent.metadata.name.clone().unwrap_or_default();
    tracing::error!(%slice, %verb, dropped = %d.what, gate = %d.gate, "the API server dropped gated fields of a ResourceSlice; enable the feature gate");
    Err(crate::PublishError::FieldsDropped {
        verb,
        slice,
        gate: d.gate,
        dropped: d.what,
        consequence: d.gate.consequence(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
    use carve_model::slices::{KubeLayout, NodeGpu, SliceOptions, build_slices, simulated_node};
    use k8s_openapi::api::resource::v1::DeviceTaint;

    fn sent() -> Vec<ResourceSlice> {
        let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 1)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        let mut o = SliceOptions::new("node-a", KubeLayout::V135Plus);
        o.sharing.mps_caps = Some(MpsCapabilities {
            memory_limit: MemoryLimit::Hard,
            compute_limit: ComputeLimit::Percentage,
        });
        o.sharing.mps = true;
        o.sharing.timeslice = true;
        let mut s = build_slices(&gpus, &o).unwrap();
        let d = &mut s[1].spec.devices.as_mut().unwrap()[0];
        d.taints = Some(vec![DeviceTaint {
            key: "gpu.carve.dev/xid".into(),
            value: Some("79".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
        s
    }

    #[test]
    fn each_gate_is_named_once_for_what_it_drops() {
        let s = sent();
        for x in &s {
            assert_eq!(dropped_fields(x, x), Vec::new());
        }
        let devices = &s[1];
        let tainted = devices.spec.devices.as_ref().unwrap()[0].name.clone();

        // DRADeviceTaints off.
        let mut st = devices.clone();
        for d in st.spec.devices.iter_mut().flatten() {
            d.taints = None;
        }
        assert_eq!(
            dropped_fields(devices, &st),
            [Dropped {
                gate: FeatureGate::DeviceTaints,
                what: format!("taints of 1 devices (first: {tainted})"),
            }]
        );

        // DRAConsumableCapacity off: both sharing fields, one entry.
        let mut st = devices.clone();
        for d in st.spec.devices.iter_mut().flatten() {
            d.allow_multiple_allocations = None;
            for c in d.capacity.iter_mut().flatten() {
                c.1.request_policy = None;
            }
        }
        let d = dropped_fields(devices, &st);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].gate, FeatureGate::ConsumableCapacity);
        assert!(
            d[0].what.starts_with("allowMultipleAllocations of ")
                && d[0].what.contains(" and capacity requestPolicy of "),
            "{}",
            d[0].what
        );
        assert!(d[0].what.contains("-mps"), "{}", d[0].what);

        // All three off: three entries in gate order.
        for dd in st.spec.devices.iter_mut().flatten() {
            dd.taints = None;
            dd.consumes_counters = None;
        }
        let gates: Vec<FeatureGate> = dropped_fields(devices, &st)
            .into_iter()
            .map(|d| d.gate)
            .collect();
        assert_eq!(
            gates,
            [
                FeatureGate::PartitionableDevices,
                FeatureGate::DeviceTaints,
                FeatureGate::ConsumableCapacity
            ]
        );
    }
}
