//! MPS, MIG-MPS and time-slice devices (consumable capacity, KEP-5075), and the
//! translation of an allocation's `consumedCapacity` into MPS limits.
//!
//! Pure: builds `k8s-openapi` values, starts no daemon (that is `carve-mps`).
//!
//! | device | name | shares | capacities |
//! |---|---|---|---|
//! | MPS on the whole GPU | `gpu-0-mps` | many | `memory`, `multiprocessors` with a `requestPolicy` |
//! | MPS on one MIG placement | `gpu-0-mig-1g10gb-3-mps` | many | as above, of the instance |
//! | time-sliced whole GPU | `gpu-0-ts` | many | informational only (every share consumes 0) |
//!
//! # Counters: charged once per multi-allocatable device
//!
//! The upstream structured allocator charges a device's `consumesCounters` only
//! for the *first* share of a device with `allowMultipleAllocations: true`:
//! `allocateDevice` in
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/experimental/allocator_experimental.go`
//! sets `skipCounterCheck := allowMultipleAllocations && alloc.deviceCapacityInUse(device.id)`
//! (kubernetes/kubernetes issue #134100). Committed shares count once when the
//! counters are rebuilt in a later scheduling cycle since PR #139040 (merged
//! 2026-05; before it committed shares were not counted at all, so a later
//! exclusive allocation could slip past), and PR #140437 (2026-07) stops a
//! second charge for shares recorded without `consumedCapacity`.
//!
//! So a shareable device consumes exactly what its exclusive twin consumes:
//! `gpu-<i>-mps` and `gpu-<i>-ts` consume the whole counter set (like `gpu-<i>`),
//! `gpu-<i>-mig-<p>-<s>-mps` consumes what `gpu-<i>-mig-<p>-<s>` consumes. The
//! first share takes the counters, further shares ride on it, and anything that
//! overlaps — the whole GPU, a MIG placement, the other sharing form — no longer
//! fits. Sharing devices always publish capacities, so every share carries
//! `consumedCapacity` and never hits the #140433 double charge. On a scheduler
//! without #139040 the exclusion only holds within one scheduling cycle: the
//! plugin must still refuse to prepare conflicting uses of one GPU.
//!
//! # Isolation levels (attributes `mpsMemoryLimit`, `mpsComputeLimit`)
//!
//! - memory `hard`: a limit the workload cannot escape: NVIDIA's memory
//!   partitioning (`dmem`/misc, set through NVML or `nvidia-smi memory-limits`)
//!   on a whole, non-MIG GPU. carve does not set it up yet, so it publishes
//!   `hard` nowhere, and never on MIG (unsupported there). `client`: a limit the
//!   CUDA client applies: the v2 `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` variable, or
//!   a v3 namespace's pinned limit, which a tenant can escape (NVIDIA Dynamo
//!   measured it: one variable entry naming an invisible device drops it).
//! - compute `partition`: static SM partitions (dedicated SMs); `percentage`: an
//!   active-thread percentage the server applies per namespace, overriding the
//!   client's variable. It is a ceiling on the threads a client may use, not a
//!   reservation: idle shares' SMs are not held for them, and a busy share does
//!   not get its percentage back from others. `client`: the
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` variable.
//! - Never isolated by MPS at any level: L2 cache and memory bandwidth, and a
//!   fatal GPU fault in one client reaches every client of the same server.
//!   Time-slicing isolates neither memory nor faults.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device,
    DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};

use crate::names::{DeviceName, NameError};
use crate::slices::limits;
use crate::slices::quantity::{self, QuantityError};
use crate::slices::{counter_set_name, semver_of};
use crate::spec::PhysicalGpu;

/// Capacity name of device memory (bytes).
pub const MEMORY: &str = "memory";
/// Capacity name of streaming multiprocessors.
pub const MULTIPROCESSORS: &str = "multiprocessors";
/// Smallest memory share, MiB: a CUDA context alone needs a few hundred MiB.
pub const MEMORY_MIN_MIB: u64 = 1024;
/// Memory share granularity, MiB. MPS takes limits as `<n>M`, so any MiB
/// multiple is exact; 256 MiB keeps the number of distinct shares sane.
pub const MEMORY_STEP_MIB: u64 = 256;
/// SM share granularity: one TPC (2 SMs on Volta and later). MPS rounds an
/// active-thread percentage to its hardware granularity; INFERRED to be a TPC.
pub const SM_STEP: u64 = 2;
/// Smallest SM share.
pub const SM_MIN: u64 = 2;

/// How a device is shared; the `sharing` attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharing {
    /// One claim at a time (whole GPU or MIG placement).
    Exclusive,
    /// CUDA MPS: concurrent clients with per-claim limits.
    Mps,
    /// Time-slicing: concurrent clients, no limits, no isolation.
    Timeslice,
}

impl Sharing {
    /// The attribute value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Mps => "mps",
            Self::Timeslice => "timeslice",
        }
    }
}

/// Enforcement of the per-claim memory limit; the `mpsMemoryLimit` attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryLimit {
    /// Applied by the CUDA client (the v2 variable, a v3 namespace's pinned
    /// limit): the workload can escape it.
    Client,
    /// A limit the workload cannot escape (memory partitioning on a whole,
    /// non-MIG GPU). Not published by carve today.
    Hard,
}

impl MemoryLimit {
    /// The attribute value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hard => "hard",
            Self::Client => "client",
        }
    }
}

/// Enforcement of the per-claim SM share; the `mpsComputeLimit` attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeLimit {
    /// The environment variable only: the workload can raise it.
    Client,
    /// Active-thread percentage applied by the server per namespace.
    Percentage,
    /// Static SM partition: dedicated SMs.
    Partition,
}

impl ComputeLimit {
    /// The attribute value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Partition => "partition",
            Self::Percentage => "percentage",
            Self::Client => "client",
        }
    }
}

/// What the node's MPS setup enforces, detected at plugin start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsCapabilities {
    /// Memory limit enforcement.
    pub memory_limit: MemoryLimit,
    /// SM share enforcement.
    pub compute_limit: ComputeLimit,
}

impl MpsCapabilities {
    /// Whether a unit with these levels serves one claim at a time: MPS v2,
    /// the only protocol carve runs with compute limit `client` (v3's
    /// namespaces apply the percentage in the server). Under v2 every client
    /// gets the daemon's pipe directory, which is its control endpoint, so a
    /// client can `quit` the daemon or change every server's limits; carve
    /// gives such a unit to one claim (see [`MpsDeviceSpec::device`]).
    #[must_use]
    pub fn one_claim_per_unit(self) -> bool {
        self.compute_limit == ComputeLimit::Client
    }

    /// The `mpsDaemon` attribute: `claim` where the unit's control daemon
    /// serves one claim whose containers can drive it (v2), `shared` where
    /// it serves several claims, each confined to its namespace (v3).
    #[must_use]
    pub fn daemon_attribute(self) -> &'static str {
        if self.one_claim_per_unit() {
            "claim"
        } else {
            "shared"
        }
    }

    /// These levels on a MIG instance: memory partitioning does not support
    /// MIG, so memory is at most `client` there.
    #[must_use]
    pub fn on_mig(self) -> Self {
        Self {
            memory_limit: self.memory_limit.min(MemoryLimit::Client),
            ..self
        }
    }
}

/// Why a sharing device cannot be described or an allocation not translated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SharingError {
    /// The MIG profile is not one of the GPU's.
    #[error("GPU {gpu}: no MIG profile {profile:?}")]
    UnknownProfile {
        /// GPU index.
        gpu: u32,
        /// The profile name.
        profile: String,
    },
    /// The start is not an allowed placement of the profile.
    #[error("GPU {gpu}: start {start} is not a placement of {profile}")]
    NotAPlacement {
        /// GPU index.
        gpu: u32,
        /// Profile name.
        profile: String,
        /// Placement start.
        start: u8,
    },
    /// The profile has no device-name form.
    #[error("GPU {gpu}: profile has no device name")]
    Name {
        /// GPU index.
        gpu: u32,
        /// The naming error.
        #[source]
        source: NameError,
    },
    /// The device is too small for even one share plus one step.
    #[error("device {device}: {capacity} {value} is below the smallest share {min} plus one step")]
    TooSmall {
        /// Device name.
        device: String,
        /// Capacity name.
        capacity: &'static str,
        /// Its total.
        value: u64,
        /// Smallest share.
        min: u64,
    },
    /// A GPU value cannot be published as an attribute.
    #[error("GPU {gpu}: attribute {attribute} value {value:?}: {why}")]
    Attribute {
        /// GPU index.
        gpu: u32,
        /// Attribute name.
        attribute: &'static str,
        /// The value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
    /// An allocation of an MPS device carries no `consumedCapacity` entry for a capacity.
    #[error(
        "device {device}: allocation has no consumedCapacity for {capacity:?} (needs a scheduler with DRAConsumableCapacity)"
    )]
    MissingCapacity {
        /// Device name.
        device: String,
        /// Capacity name.
        capacity: &'static str,
    },
    /// A consumed quantity does not parse.
    #[error("device {device}: consumedCapacity {capacity:?}")]
    Quantity {
        /// Device name.
        device: String,
        /// Capacity name.
        capacity: &'static str,
        /// The parse error.
        #[source]
        source: QuantityError,
    },
    /// A consumed quantity is negative.
    #[error("device {device}: consumedCapacity {capacity:?} = {value} is negative")]
    Negative {
        /// Device name.
        device: String,
        /// Capacity name.
        capacity: &'static str,
        /// The value as given.
        value: String,
    },
    /// A consumed quantity exceeds what one share of the device may have.
    #[error(
        "device {device}: consumedCapacity {capacity:?} = {value} exceeds the device's largest share {max} {unit}"
    )]
    BeyondDevice {
        /// Device name.
        device: String,
        /// Capacity name.
        capacity: &'static str,
        /// The value as given.
        value: String,
        /// Largest allowed share.
        max: u64,
        /// Unit of `max` (`MiB` or `SMs`).
        unit: &'static str,
    },
    /// A capacity's `requestPolicy` breaks a `resource.k8s.io/v1` rule.
    #[error("capacity {capacity:?}: requestPolicy: {rule}")]
    Policy {
        /// Capacity name.
        capacity: String,
        /// The broken rule.
        rule: String,
    },
}

/// A `validRange` request policy in whole units (MiB or SMs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareRange {
    /// Capacity total.
    pub value: u64,
    /// Smallest share.
    pub min: u64,
    /// Granularity.
    pub step: u64,
    /// Largest share: `min + n·step ≤ value`.
    pub max: u64,
    /// Share taken when a request names no amount (= `min`).
    pub default: u64,
}

impl ShareRange {
    fn new(value: u64, min: u64, step: u64) -> Option<Self> {
        if value < min + step {
            return None;
        }
        let max = min + (value - min) / step * step;
        Some(Self {
            value,
            min,
            step,
            max,
            default: min,
        })
    }

    /// Round `v` as the scheduler does: up to `min`, then up to the next step;
    /// `None` above `max` (not allocatable).
    #[must_use]
    pub fn round(&self, v: u64) -> Option<u64> {
        if v > self.max {
            return None;
        }
        if v <= self.min {
            return Some(self.min);
        }
        let r = self.min + (v - self.min).div_ceil(self.step) * self.step;
        (r <= self.max).then_some(r)
    }
}

/// One MPS-shareable device (whole GPU or MIG placement) as `translate` and
/// the daemon supervisor need it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDeviceSpec {
    /// `gpu-<i>-mps` or `gpu-<i>-mig-<p>-<s>-mps`.
    pub name: DeviceNameString,
    /// GPU index.
    pub gpu: u32,
    /// UUID of the physical GPU.
    pub gpu_uuid: String,
    /// MIG profile and placement start, for MIG-MPS.
    pub mig: Option<(String, u8)>,
    /// Device memory of the shared unit, MiB.
    pub memory_mib: u64,
    /// SMs of the shared unit.
    pub multiprocessors: u32,
    /// Enforcement levels published with the device.
    pub caps: MpsCapabilities,
}

/// A device name kept as its string form (serialisable).
pub type DeviceNameString = String;

impl MpsDeviceSpec {
    /// The MPS device of a whole GPU.
    ///
    /// # Errors
    /// [`SharingError::TooSmall`] if the GPU cannot hold one share plus a step.
    pub fn whole(gpu: &PhysicalGpu, caps: MpsCapabilities) -> Result<Self, SharingError> {
        let s = Self {
            name: DeviceName::Mps { gpu: gpu.index }.to_string(),
            gpu: gpu.index,
            gpu_uuid: gpu.uuid.clone(),
            mig: None,
            memory_mib: gpu.spec.memory_mib,
            multiprocessors: gpu.spec.multiprocessors,
            caps,
        };
        s.ranges()?;
        Ok(s)
    }

    /// The MPS device of MIG placement `profile` at `start`.
    ///
    /// # Errors
    /// Unknown profile or placement, or an instance too small to share.
    pub fn mig(
        gpu: &PhysicalGpu,
        profile: &str,
        start: u8,
        caps: MpsCapabilities,
    ) -> Result<Self, SharingError> {
        let p = gpu
            .spec
            .profile(profile)
            .ok_or_else(|| SharingError::UnknownProfile {
                gpu: gpu.index,
                profile: profile.to_string(),
            })?;
        if !p.placements.iter().any(|pl| pl.start == start) {
            return Err(SharingError::NotAPlacement {
                gpu: gpu.index,
                profile: profile.to_string(),
                start,
            });
        }
        let name = match DeviceName::mig(gpu.index, profile, start) {
            Ok(DeviceName::Mig {
                gpu,
                profile,
                start,
            }) => DeviceName::MigMps {
                gpu,
                profile,
                start,
            },
            Ok(other) => other,
            Err(source) => {
                return Err(SharingError::Name {
                    gpu: gpu.index,
                    source,
                });
            }
        };
        let s = Self {
            name: name.to_string(),
            gpu: gpu.index,
            gpu_uuid: gpu.uuid.clone(),
            mig: Some((profile.to_string(), start)),
            memory_mib: p.memory_mib,
            multiprocessors: p.multiprocessors,
            caps: caps.on_mig(),
        };
        s.ranges()?;
        Ok(s)
    }

    /// Memory share range, MiB.
    ///
    /// # Errors
    /// [`SharingError::TooSmall`].
    pub fn memory_range(&self) -> Result<ShareRange, SharingError> {
        ShareRange::new(self.memory_mib, MEMORY_MIN_MIB, MEMORY_STEP_MIB).ok_or_else(|| {
            SharingError::TooSmall {
                device: self.name.clone(),
                capacity: MEMORY,
                value: self.memory_mib,
                min: MEMORY_MIN_MIB,
            }
        })
    }

    /// SM share range.
    ///
    /// # Errors
    /// [`SharingError::TooSmall`].
    pub fn sm_range(&self) -> Result<ShareRange, SharingError> {
        let v = u64::from(self.multiprocessors);
        ShareRange::new(v, SM_MIN, SM_STEP).ok_or_else(|| SharingError::TooSmall {
            device: self.name.clone(),
            capacity: MULTIPROCESSORS,
            value: v,
            min: SM_MIN,
        })
    }

    fn ranges(&self) -> Result<(ShareRange, ShareRange), SharingError> {
        Ok((self.memory_range()?, self.sm_range()?))
    }

    /// The `Device` to publish. `consumes` is what the exclusive twin consumes:
    /// [`consume_all`] of the GPU's counter set for `gpu-<i>-mps`, the MIG
    /// placement's own `consumesCounters` for MIG-MPS (see the module docs).
    ///
    /// # Errors
    /// An attribute that cannot be published, or a broken request policy.
    pub fn device(
        &self,
        gpu: &PhysicalGpu,
        consumes: Vec<DeviceCounterConsumption>,
    ) -> Result<Device, SharingError> {
        let (mem, sm) = self.ranges()?;
        let mut attrs = common_attributes(gpu)?;
        attrs.insert("sharing".into(), a_str(Sharing::Mps.as_str()));
        attrs.insert(
            "mpsMemoryLimit".into(),
            a_str(self.caps.memory_limit.as_str()),
        );
        attrs.insert(
            "mpsComputeLimit".into(),
            a_str(self.caps.compute_limit.as_str()),
        );
        attrs.insert("mpsDaemon".into(), a_str(self.caps.daemon_attribute()));
        match &self.mig {
            None => {
                attrs.insert("type".into(), a_str("mps"));
            }
            Some((profile, start)) => {
                let p = gpu
                    .spec
                    .profile(profile)
                    .ok_or_else(|| SharingError::UnknownProfile {
                        gpu: gpu.index,
                        profile: profile.clone(),
                    })?;
                if let Some(u) = attrs.remove("uuid") {
                    attrs.insert("parentUUID".into(), u);
                }
                attrs.insert("type".into(), a_str("mig-mps"));
                attrs.insert("profile".into(), a_str(profile.clone()));
                attrs.insert("memorySlices".into(), a_int(p.memory_slices));
                attrs.insert("placementStart".into(), a_int(*start));
                attrs.insert("computeSlices".into(), a_int(p.compute_slices));
            }
        }
        let policy = if self.caps.one_claim_per_unit() {
            whole_unit_capacity
        } else {
            range_capacity
        };
        let capacity = BTreeMap::from([
            (MEMORY.to_string(), policy(mem, quantity::mebibytes)),
            (MULTIPROCESSORS.to_string(), policy(sm, quantity::int)),
        ]);
        for (k, c) in &capacity {
            check_request_policy(k, c)?;
        }
        Ok(Device {
            name: self.name.clone(),
            attributes: Some(attrs),
            capacity: Some(capacity),
            allow_multiple_allocations: Some(true),
            consumes_counters: (!consumes.is_empty()).then_some(consumes),
            ..Default::default()
        })
    }
}

/// The time-sliced whole GPU `gpu-<i>-ts`: shareable without limits. Its
/// capacities are informational (for selectors); each share consumes 0 of them
/// (`validValues: [0]`), so a request for any amount does not fit. `consumes`
/// is [`consume_all`] of the GPU's counter set.
///
/// # Errors
/// An attribute that cannot be published.
pub fn time_slice_device(
    gpu: &PhysicalGpu,
    consumes: Vec<DeviceCounterConsumption>,
) -> Result<Device, SharingError> {
    let mut attrs = common_attributes(gpu)?;
    attrs.insert("type".into(), a_str("timeslice"));
    attrs.insert("sharing".into(), a_str(Sharing::Timeslice.as_str()));
    let zero = || CapacityRequestPolicy {
        default: Some(quantity::int(0)),
        valid_values: Some(vec![quantity::int(0)]),
        valid_range: None,
    };
    let capacity = BTreeMap::from([
        (
            MEMORY.to_string(),
            DeviceCapacity {
                value: quantity::mebibytes(gpu.spec.memory_mib),
                request_policy: Some(zero()),
            },
        ),
        (
            MULTIPROCESSORS.to_string(),
            DeviceCapacity {
                value: quantity::int(gpu.spec.multiprocessors.into()),
                request_policy: Some(zero()),
            },
        ),
    ]);
    for (k, c) in &capacity {
        check_request_policy(k, c)?;
    }
    Ok(Device {
        name: DeviceName::TimeSlice { gpu: gpu.index }.to_string(),
        attributes: Some(attrs),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        consumes_counters: (!consumes.is_empty()).then_some(consumes),
        ..Default::default()
    })
}

/// Consume every counter of `set` at its full value: what the whole GPU, its
/// MPS device and its time-slice device consume.
// `..Default::default()` is needed with k8s-openapi's v1_37 feature.
#[allow(clippy::needless_update)]
#[must_use]
pub fn consume_all(set: &CounterSet) -> Vec<DeviceCounterConsumption> {
    vec![DeviceCounterConsumption {
        counter_set: set.name.clone(),
        counters: set.counters.clone(),
        ..Default::default()
    }]
}

/// The counter set of a GPU that cannot do MIG (the slice builder publishes none
/// for it): `memory` and `multiprocessors` at the GPU's totals, named
/// `gpu-<i>-counters`. When the GPU publishes MPS or time-slice devices, the
/// whole GPU and both sharing devices consume all of it ([`consume_all`]), which
/// makes the three mutually exclusive.
#[must_use]
pub fn plain_counter_set(gpu: &PhysicalGpu) -> CounterSet {
    CounterSet {
        name: counter_set_name(gpu.index),
        counters: BTreeMap::from([
            (
                MEMORY.to_string(),
                Counter {
                    value: quantity::mebibytes(gpu.spec.memory_mib),
                },
            ),
            (
                MULTIPROCESSORS.to_string(),
                Counter {
                    value: quantity::int(gpu.spec.multiprocessors.into()),
                },
            ),
        ]),
    }
}

/// Per-claim MPS limits from one allocation's `consumedCapacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsLimits {
    /// Device memory limit, MiB (a multiple of [`MEMORY_STEP_MIB`] above the minimum).
    pub memory_limit_mib: u64,
    /// SMs granted.
    pub multiprocessors: u32,
    /// The same share as an active-thread percentage of the shared unit,
    /// rounded up, in 1..=100.
    pub active_thread_percentage: u32,
}

fn consumed<'a>(m: &'a BTreeMap<String, Quantity>, name: &str) -> Option<&'a Quantity> {
    m.get(name)
        .or_else(|| m.get(&format!("{}/{name}", crate::DRIVER_NAME)))
}

/// Translate an allocation's `consumedCapacity` for an MPS device into limits,
/// rounding as the device's request policy does (up to `min`, then up to the
/// next step). Keys may be bare (`memory`) or qualified (`gpu.carve.dev/memory`).
///
/// # Errors
/// A missing entry, a value that does not parse or is negative, or one above
/// the device's largest share.
pub fn translate(
    consumed_capacity: &BTreeMap<String, Quantity>,
    device: &MpsDeviceSpec,
) -> Result<MpsLimits, SharingError> {
    let (mem, sm) = device.ranges()?;
    let get = |capacity: &'static str, unit: u64, range: ShareRange, unit_name| {
        let q =
            consumed(consumed_capacity, capacity).ok_or_else(|| SharingError::MissingCapacity {
                device: device.name.clone(),
                capacity,
            })?;
        let a = quantity::parse(q).map_err(|source| SharingError::Quantity {
            device: device.name.clone(),
            capacity,
            source,
        })?;
        if a.milli() < 0 {
            return Err(SharingError::Negative {
                device: device.name.clone(),
                capacity,
                value: q.0.clone(),
            });
        }
        let beyond = || SharingError::BeyondDevice {
            device: device.name.clone(),
            capacity,
            value: q.0.clone(),
            max: range.max,
            unit: unit_name,
        };
        let whole = u64::try_from(a.value_ceil()).map_err(|_| beyond())?;
        range.round(whole.div_ceil(unit)).ok_or_else(beyond)
    };
    let memory_limit_mib = get(MEMORY, 1024 * 1024, mem, "MiB")?;
    let sms = get(MULTIPROCESSORS, 1, sm, "SMs")?;
    let total = u64::from(device.multiprocessors);
    let pct = (sms * 100).div_ceil(total).clamp(1, 100);
    Ok(MpsLimits {
        memory_limit_mib,
        multiprocessors: u32::try_from(sms).unwrap_or(u32::MAX),
        active_thread_percentage: u32::try_from(pct).unwrap_or(100),
    })
}

/// Check a capacity's `requestPolicy` against the `resource.k8s.io/v1` rules
/// (dra-api.md A.2): `default` required; at most one of `validValues` and
/// `validRange`; values ascending, at most 10, each within the capacity and
/// containing `default`; range `0 ≤ min ≤ max ≤ value`, `step > 0`,
/// `min + step ≤ value`, `max` and `default` on `min + n·step`, `default` in range.
///
/// # Errors
/// [`SharingError::Policy`] naming the capacity and the rule.
pub fn check_request_policy(name: &str, cap: &DeviceCapacity) -> Result<(), SharingError> {
    let Some(p) = &cap.request_policy else {
        return Ok(());
    };
    let bad = |rule: String| SharingError::Policy {
        capacity: name.to_string(),
        rule,
    };
    let q = |x: &Quantity| quantity::parse(x).map_err(|e| bad(e.to_string()));
    let value = q(&cap.value)?;
    let default = match &p.default {
        Some(d) => q(d)?,
        None if p.valid_values.is_some() || p.valid_range.is_some() => {
            return Err(bad(
                "default is required with validValues or validRange".into()
            ));
        }
        None => return Ok(()),
    };
    if default > value || default.milli() < 0 {
        return Err(bad(format!("default {default} not in 0..={value}")));
    }
    match (&p.valid_values, &p.valid_range) {
        (Some(_), Some(_)) => Err(bad("both validValues and validRange are set".into())),
        (Some(vs), None) => {
            if vs.is_empty() || vs.len() > 10 {
                return Err(bad(format!("{} validValues, want 1..=10", vs.len())));
            }
            let vs: Vec<_> = vs.iter().map(q).collect::<Result<_, _>>()?;
            if vs.windows(2).any(|w| w[0] >= w[1]) {
                return Err(bad("validValues are not strictly ascending".into()));
            }
            if vs.iter().any(|v| *v > value) {
                return Err(bad(format!("a validValue exceeds the capacity {value}")));
            }
            if !vs.contains(&default) {
                return Err(bad(format!("validValues do not contain default {default}")));
            }
            Ok(())
        }
        (None, Some(r)) => check_range(r, value, default, &q).map_err(bad),
        (None, None) => Ok(()),
    }
}

fn check_range(
    r: &CapacityRequestPolicyRange,
    value: quantity::Amount,
    default: quantity::Amount,
    q: &dyn Fn(&Quantity) -> Result<quantity::Amount, SharingError>,
) -> Result<(), String> {
    let e = |x: SharingError| x.to_string();
    let min = q(&r.min).map_err(e)?;
    if min.milli() < 0 || min > value {
        return Err(format!("min {min} not in 0..={value}"));
    }
    let max = match &r.max {
        Some(m) => {
            let m = q(m).map_err(e)?;
            if m < min || m > value {
                return Err(format!("max {m} not in {min}..={value}"));
            }
            Some(m)
        }
        None => None,
    };
    if default < min || max.is_some_and(|m| default > m) {
        return Err(format!("default {default} outside the range"));
    }
    if let Some(s) = &r.step {
        let s = q(s).map_err(e)?;
        if s.milli() <= 0 {
            return Err(format!("step {s} is not positive"));
        }
        if min.milli() + s.milli() > value.milli() {
            return Err(format!("min {min} + step {s} exceeds the capacity {value}"));
        }
        let on_step = |x: quantity::Amount| (x.milli() - min.milli()) % s.milli() == 0;
        if max.is_some_and(|m| !on_step(m)) {
            return Err(format!("max is not min + n·step (step {s})"));
        }
        if !on_step(default) {
            return Err(format!("default {default} is not min + n·step (step {s})"));
        }
    }
    Ok(())
}

fn range_capacity(r: ShareRange, unit: fn(u64) -> Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value: unit(r.value),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(unit(r.default)),
            valid_values: None,
            valid_range: Some(CapacityRequestPolicyRange {
                min: unit(r.min),
                max: Some(unit(r.max)),
                step: Some(unit(r.step)),
            }),
        }),
    }
}

/// One claim per unit (MPS v2, [`MpsCapabilities::one_claim_per_unit`]):
/// the only valid amount is the largest share, and the default too, so any
/// request is rounded up to it ("the smallest valid value that is greater
/// than or equal to the request", `CapacityRequestPolicy.validValues`,
/// resource.k8s.io/v1) and a second claim no longer fits the capacity the
/// first consumed.
fn whole_unit_capacity(r: ShareRange, unit: fn(u64) -> Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value: unit(r.value),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(unit(r.max)),
            valid_values: Some(vec![unit(r.max)]),
            valid_range: None,
        }),
    }
}

fn a_str(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}

fn a_int(v: impl Into<i64>) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v.into()),
        ..Default::default()
    }
}

/// The GPU attributes every carve device carries (as the slice builder's).
fn common_attributes(gpu: &PhysicalGpu) -> Result<BTreeMap<String, DeviceAttribute>, SharingError> {
    let spec = &gpu.spec;
    let checked = |attribute: &'static str, v: &str| {
        if v.len() > limits::ATTRIBUTE_STRING_BYTES {
            Err(SharingError::Attribute {
                gpu: gpu.index,
                attribute,
                value: v.to_string(),
                why: "longer than 64 bytes",
            })
        } else {
            Ok(a_str(v))
        }
    };
    let driver = semver_of(&gpu.driver_version).ok_or_else(|| SharingError::Attribute {
        gpu: gpu.index,
        attribute: "driverVersion",
        value: gpu.driver_version.clone(),
        why: "not a dotted numeric version",
    })?;
    let mut product = spec.product_name.clone();
    while product.len() > limits::ATTRIBUTE_STRING_BYTES {
        product.pop();
    }
    let (cc_major, cc_minor) = spec.cuda_compute_capability;
    let mut a = BTreeMap::new();
    a.insert("productName".into(), a_str(product));
    a.insert("architecture".into(), a_str(spec.architecture.as_str()));
    a.insert("index".into(), a_int(gpu.index));
    a.insert("minor".into(), a_int(gpu.minor));
    a.insert(
        "migCapable".into(),
        DeviceAttribute {
            bool: Some(spec.mig_capable),
            ..Default::default()
        },
    );
    a.insert(
        "cudaComputeCapability".into(),
        DeviceAttribute {
            version: Some(format!("{cc_major}.{cc_minor}.0")),
            ..Default::default()
        },
    );
    a.insert(
        "driverVersion".into(),
        DeviceAttribute {
            version: Some(driver),
            ..Default::default()
        },
    );
    if let Some(b) = &gpu.pci_bus_id {
        a.insert(
            "resource.kubernetes.io/pciBusID".into(),
            checked("resource.kubernetes.io/pciBusID", b)?,
        );
    }
    if let Some(r) = &gpu.pcie_root {
        a.insert(
            "resource.kubernetes.io/pcieRoot".into(),
            checked("resource.kubernetes.io/pcieRoot", r)?,
        );
    }
    a.insert("uuid".into(), checked("uuid", &gpu.uuid)?);
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slices::{
        KubeLayout, NodeGpu, SharingOptions, SliceOptions, build_slices, consumption_fits,
        simulated_node,
    };

    const CAPS: MpsCapabilities = MpsCapabilities {
        memory_limit: MemoryLimit::Hard,
        compute_limit: ComputeLimit::Percentage,
    };

    fn gpu(model: &str) -> PhysicalGpu {
        simulated_node(model, 1).unwrap().remove(0)
    }

    fn q(s: &str) -> Quantity {
        Quantity(s.to_string())
    }

    fn cc(mem: &str, sm: &str) -> BTreeMap<String, Quantity> {
        BTreeMap::from([
            (MEMORY.to_string(), q(mem)),
            (MULTIPROCESSORS.to_string(), q(sm)),
        ])
    }

    #[test]
    fn a_v2_unit_is_published_for_one_claim_and_v3_for_many() {
        let g = gpu("h100-80gb");
        let v2 = MpsCapabilities {
            memory_limit: MemoryLimit::Client,
            compute_limit: ComputeLimit::Client,
        };
        assert!(v2.one_claim_per_unit() && !CAPS.one_claim_per_unit());
        let spec = MpsDeviceSpec::whole(&g, v2).unwrap();
        let d = spec.device(&g, vec![]).unwrap();
        let attrs = d.attributes.as_ref().unwrap();
        assert_eq!(attrs["mpsDaemon"].string.as_deref(), Some("claim"));
        let (mem, sm) = spec.ranges().unwrap();
        let caps = d.capacity.as_ref().unwrap();
        for (name, max, value, unit) in [
            (
                MEMORY,
                mem.max,
                mem.value,
                quantity::mebibytes as fn(u64) -> Quantity,
            ),
            (MULTIPROCESSORS, sm.max, sm.value, quantity::int),
        ] {
            let p = caps[name].request_policy.as_ref().unwrap();
            // Any request rounds up to the one valid value: the whole unit.
            assert_eq!(p.valid_values.as_deref(), Some(&[unit(max)][..]), "{name}");
            assert_eq!(p.default, Some(unit(max)), "{name}");
            assert!(p.valid_range.is_none(), "{name}");
            // A second claim's share does not fit beside the first's.
            assert!(2 * max > value, "{name}: {max} twice fits in {value}");
        }
        // What the first claim consumed translates to the whole unit.
        let l = translate(
            &BTreeMap::from([
                (MEMORY.to_string(), quantity::mebibytes(mem.max)),
                (MULTIPROCESSORS.to_string(), quantity::int(sm.max)),
            ]),
            &spec,
        )
        .unwrap();
        assert_eq!(l.memory_limit_mib, mem.max);
        assert_eq!(l.active_thread_percentage, 100);
        // v3: ranges, many claims.
        let v3 = MpsDeviceSpec::whole(&g, CAPS)
            .unwrap()
            .device(&g, vec![])
            .unwrap();
        assert_eq!(
            v3.attributes.as_ref().unwrap()["mpsDaemon"]
                .string
                .as_deref(),
            Some("shared")
        );
        let p = v3.capacity.as_ref().unwrap()[MEMORY]
            .request_policy
            .clone()
            .unwrap();
        assert!(p.valid_range.is_some() && p.valid_values.is_none());
    }

    #[test]
    fn translate_rounds_like_the_request_policy() {
        let g = gpu("h100-80gb");
        let d = MpsDeviceSpec::whole(&g, CAPS).unwrap();
        let mem = d.memory_range().unwrap();
        let total = d.multiprocessors;
        // (memory, SMs) -> (MiB, SMs)
        let table: &[(&str, &str, u64, u32)] = &[
            ("0", "0", 1024, 2),              // below min: min
            ("1", "1", 1024, 2),              // one byte: min
            ("1Gi", "2", 1024, 2),            // exactly min
            ("1025Mi", "3", 1280, 4),         // just above: next step
            ("1280Mi", "4", 1280, 4),         // on a step
            ("1.5Gi", "5", 1536, 6),          // fractional suffix
            ("1073741825", "2500m", 1280, 4), // bytes, milli SMs
            ("10G", "16", 9728, 16),          // decimal suffix: 9536.7 MiB -> 9728
        ];
        for &(m, s, want_mib, want_sm) in table {
            let l = translate(&cc(m, s), &d).unwrap_or_else(|e| panic!("{m} {s}: {e}"));
            assert_eq!(l.memory_limit_mib, want_mib, "{m}");
            assert_eq!(l.multiprocessors, want_sm, "{s}");
            let pct = (u64::from(want_sm) * 100).div_ceil(u64::from(total)) as u32;
            assert_eq!(l.active_thread_percentage, pct, "{s}");
        }
        // The largest share is allowed, one step beyond is not.
        let max = format!("{}Mi", mem.max);
        let l = translate(&cc(&max, &total.to_string()), &d).unwrap();
        assert_eq!(l.memory_limit_mib, mem.max);
        assert_eq!(l.active_thread_percentage, 100);
        let over = format!("{}Mi", mem.max + 1);
        assert!(matches!(
            translate(&cc(&over, "2"), &d),
            Err(SharingError::BeyondDevice {
                capacity: MEMORY,
                ..
            })
        ));
        assert!(matches!(
            translate(&cc("1Gi", &(total + 1).to_string()), &d),
            Err(SharingError::BeyondDevice {
                capacity: MULTIPROCESSORS,
                ..
            })
        ));
    }

    #[test]
    fn translate_on_a_mig_instance_uses_its_own_totals() {
        let g = gpu("h100-80gb");
        let d = MpsDeviceSpec::mig(&g, "1g.10gb", 3, CAPS).unwrap();
        assert_eq!(d.name, "gpu-0-mig-1g10gb-3-mps");
        let p = g.spec.profile("1g.10gb").unwrap();
        let l = translate(&cc("2Gi", "4"), &d).unwrap();
        assert_eq!(l.memory_limit_mib, 2048);
        assert_eq!(
            u64::from(l.active_thread_percentage),
            (400u64).div_ceil(u64::from(p.multiprocessors))
        );
        let too_big = format!("{}Mi", p.memory_mib + 1);
        assert!(matches!(
            translate(&cc(&too_big, "2"), &d),
            Err(SharingError::BeyondDevice { .. })
        ));
    }

    #[test]
    fn translate_accepts_qualified_keys_and_names_what_is_missing() {
        let g = gpu("h100-80gb");
        let d = MpsDeviceSpec::whole(&g, CAPS).unwrap();
        let qualified = BTreeMap::from([
            ("gpu.carve.dev/memory".to_string(), q("2Gi")),
            ("gpu.carve.dev/multiprocessors".to_string(), q("8")),
        ]);
        assert_eq!(translate(&qualified, &d).unwrap().memory_limit_mib, 2048);
        let e = translate(&BTreeMap::new(), &d).unwrap_err();
        assert_eq!(
            e,
            SharingError::MissingCapacity {
                device: "gpu-0-mps".into(),
                capacity: MEMORY
            }
        );
        assert!(e.to_string().contains("gpu-0-mps"));
        let only_mem = BTreeMap::from([(MEMORY.to_string(), q("2Gi"))]);
        assert!(matches!(
            translate(&only_mem, &d),
            Err(SharingError::MissingCapacity {
                capacity: MULTIPROCESSORS,
                ..
            })
        ));
        assert!(matches!(
            translate(&cc("-1Gi", "2"), &d),
            Err(SharingError::Negative { .. })
        ));
        assert!(matches!(
            translate(&cc("lots", "2"), &d),
            Err(SharingError::Quantity { .. })
        ));
    }

    #[test]
    fn a_mig_mps_device_never_publishes_hard_memory() {
        // Memory partitioning does not support MIG (NVIDIA's MPS memory
        // partitioning page), whatever the node's levels are.
        for m in crate::MODELS {
            let g = gpu(m.key);
            for p in &g.spec.profiles {
                for pl in &p.placements {
                    let Ok(d) = MpsDeviceSpec::mig(&g, &p.name, pl.start, CAPS) else {
                        continue;
                    };
                    assert_eq!(d.caps.memory_limit, MemoryLimit::Client, "{}", d.name);
                    assert_eq!(d.caps.compute_limit, CAPS.compute_limit);
                }
            }
        }
        assert_eq!(CAPS.on_mig().memory_limit, MemoryLimit::Client);
    }

    #[test]
    fn every_model_publishes_valid_request_policies() {
        for m in crate::MODELS {
            let g = gpu(m.key);
            let whole = MpsDeviceSpec::whole(&g, CAPS).unwrap();
            let d = whole.device(&g, vec![]).unwrap();
            assert_eq!(d.allow_multiple_allocations, Some(true));
            let attrs = d.attributes.as_ref().unwrap();
            assert_eq!(attrs["sharing"].string.as_deref(), Some("mps"));
            assert_eq!(attrs["mpsMemoryLimit"].string.as_deref(), Some("hard"));
            assert_eq!(
                attrs["mpsComputeLimit"].string.as_deref(),
                Some("percentage")
            );
            assert!(attrs.len() + d.capacity.as_ref().unwrap().len() <= 32);
            let ts = time_slice_device(&g, vec![]).unwrap();
            for dev in [&d, &ts] {
                for (k, c) in dev.capacity.iter().flatten() {
                    check_request_policy(k, c).unwrap();
                    assert!(c.request_policy.as_ref().unwrap().default.is_some());
                }
            }
            for p in &g.spec.profiles {
                for pl in &p.placements {
                    let s = MpsDeviceSpec::mig(&g, &p.name, pl.start, CAPS).unwrap();
                    let d = s.device(&g, vec![]).unwrap();
                    let attrs = d.attributes.as_ref().unwrap();
                    assert!(attrs.contains_key("parentUUID") && !attrs.contains_key("uuid"));
                    for (k, c) in d.capacity.iter().flatten() {
                        check_request_policy(k, c).unwrap();
                    }
                    let back: DeviceName = d.name.parse().unwrap();
                    assert_eq!(back.mig_placement(), Some((p.name.clone(), pl.start)));
                }
            }
        }
    }

    #[test]
    fn policy_checker_rejects_each_broken_rule() {
        let cap = |value: &str, p: CapacityRequestPolicy| DeviceCapacity {
            value: q(value),
            request_policy: Some(p),
        };
        let range = |min: &str, max: Option<&str>, step: Option<&str>| CapacityRequestPolicyRange {
            min: q(min),
            max: max.map(q),
            step: step.map(q),
        };
        let pol = |d: Option<&str>, r| CapacityRequestPolicy {
            default: d.map(q),
            valid_values: None,
            valid_range: Some(r),
        };
        let ok = cap("10", pol(Some("2"), range("2", Some("10"), Some("2"))));
        check_request_policy("x", &ok).unwrap();
        for (why, c) in [
            ("no default", cap("10", pol(None, range("2", None, None)))),
            (
                "max > value",
                cap("10", pol(Some("2"), range("2", Some("12"), None))),
            ),
            (
                "min > value",
                cap("10", pol(Some("12"), range("12", None, None))),
            ),
            (
                "step off",
                cap("10", pol(Some("2"), range("2", Some("9"), Some("2")))),
            ),
            (
                "default off",
                cap("10", pol(Some("3"), range("2", None, Some("2")))),
            ),
            (
                "min+step",
                cap("10", pol(Some("8"), range("8", None, Some("4")))),
            ),
            (
                "zero step",
                cap("10", pol(Some("2"), range("2", None, Some("0")))),
            ),
            (
                "default < min",
                cap("10", pol(Some("1"), range("2", None, None))),
            ),
            (
                "values not containing default",
                cap(
                    "10",
                    CapacityRequestPolicy {
                        default: Some(q("1")),
                        valid_values: Some(vec![q("2"), q("4")]),
                        valid_range: None,
                    },
                ),
            ),
            (
                "values descending",
                cap(
                    "10",
                    CapacityRequestPolicy {
                        default: Some(q("2")),
                        valid_values: Some(vec![q("4"), q("2")]),
                        valid_range: None,
                    },
                ),
            ),
        ] {
            assert!(
                matches!(
                    check_request_policy("x", &c),
                    Err(SharingError::Policy { .. })
                ),
                "{why}"
            );
        }
    }

    #[test]
    fn too_small_units_and_bad_placements_are_refused_by_name() {
        let mut g = gpu("h100-80gb");
        assert!(matches!(
            MpsDeviceSpec::mig(&g, "9g.99gb", 0, CAPS),
            Err(SharingError::UnknownProfile { .. })
        ));
        assert!(matches!(
            MpsDeviceSpec::mig(&g, "7g.80gb", 3, CAPS),
            Err(SharingError::NotAPlacement { start: 3, .. })
        ));
        g.spec.memory_mib = 1024;
        let e = MpsDeviceSpec::whole(&g, CAPS).unwrap_err();
        assert!(matches!(
            e,
            SharingError::TooSmall {
                capacity: MEMORY,
                ..
            }
        ));
        assert!(e.to_string().contains("gpu-0-mps"));
    }

    /// The upstream allocator's counter accounting for the devices in use:
    /// every *distinct* allocated device charges its `consumesCounters` once
    /// (a multi-allocatable device on its first share; later shares skip the
    /// check), and capacity is summed per share of a multi-allocatable device.
    struct Sim<'a> {
        set: &'a CounterSet,
        held: Vec<(&'a Device, Vec<BTreeMap<String, Quantity>>)>,
    }

    impl<'a> Sim<'a> {
        fn new(set: &'a CounterSet) -> Self {
            Self { set, held: vec![] }
        }

        fn allocate(&mut self, d: &'a Device, request: BTreeMap<String, Quantity>) -> bool {
            let multi = d.allow_multiple_allocations == Some(true);
            if let Some((_, shares)) = self.held.iter_mut().find(|(h, _)| h.name == d.name) {
                if !multi {
                    return false;
                }
                // Later share: capacity only, no counter check.
                for (k, c) in d.capacity.iter().flatten() {
                    let used: i128 = shares
                        .iter()
                        .chain([&request])
                        .map(|s| s.get(k).map_or(0, |v| quantity::parse(v).unwrap().milli()))
                        .sum();
                    if used > quantity::parse(&c.value).unwrap().milli() {
                        return false;
                    }
                }
                shares.push(request);
                return true;
            }
            let mut all: Vec<&Device> = self.held.iter().map(|(h, _)| *h).collect();
            all.push(d);
            if !consumption_fits(self.set, &all).unwrap() {
                return false;
            }
            self.held.push((d, vec![request]));
            true
        }
    }

    fn built(model: &str) -> (PhysicalGpu, CounterSet, Vec<Device>) {
        let g = gpu(model);
        let slices = build_slices(
            &[NodeGpu::dynamic(g.clone())],
            &SliceOptions::new("node-1", KubeLayout::V135Plus),
        )
        .unwrap();
        let set = slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .next()
            .cloned()
            .unwrap_or_else(|| plain_counter_set(&g));
        let devs = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .cloned()
            .collect();
        (g, set, devs)
    }

    fn find<'a>(devs: &'a [Device], name: &str) -> &'a Device {
        devs.iter().find(|d| d.name == name).unwrap()
    }

    #[test]
    fn mps_shares_coexist_and_exclude_mig_whole_gpu_and_time_slicing() {
        let (g, set, devs) = built("h100-80gb");
        let whole = find(&devs, "gpu-0");
        // The whole GPU consumes the entire set: what the sharing devices reuse.
        assert_eq!(whole.consumes_counters.as_ref(), Some(&consume_all(&set)));
        let mps = MpsDeviceSpec::whole(&g, CAPS)
            .unwrap()
            .device(&g, consume_all(&set))
            .unwrap();
        let ts = time_slice_device(&g, consume_all(&set)).unwrap();
        let mig = find(&devs, "gpu-0-mig-1g10gb-0");
        let mut sim = Sim::new(&set);
        for _ in 0..3 {
            assert!(sim.allocate(&mps, cc("20Gi", "32")));
        }
        // Capacity still binds the shares: 60Gi used, 30Gi more does not fit.
        assert!(!sim.allocate(&mps, cc("30Gi", "2")));
        assert!(!sim.allocate(mig, BTreeMap::new()));
        assert!(!sim.allocate(whole, BTreeMap::new()));
        assert!(!sim.allocate(&ts, cc("0", "0")));
        // Charged per share instead, two shares would already not fit: the
        // design depends on the charge-once rule.
        assert!(!consumption_fits(&set, &[&mps, &mps]).unwrap());
    }

    #[test]
    fn a_mig_instance_blocks_gpu_sharing_but_not_mps_on_another_placement() {
        let (g, set, devs) = built("h100-80gb");
        let mig0 = find(&devs, "gpu-0-mig-1g10gb-0");
        let mig1 = find(&devs, "gpu-0-mig-1g10gb-1");
        let mps = MpsDeviceSpec::whole(&g, CAPS)
            .unwrap()
            .device(&g, consume_all(&set))
            .unwrap();
        let ts = time_slice_device(&g, consume_all(&set)).unwrap();
        let mig_mps = |start: u8, twin: &Device| {
            MpsDeviceSpec::mig(&g, "1g.10gb", start, CAPS)
                .unwrap()
                .device(&g, twin.consumes_counters.clone().unwrap())
                .unwrap()
        };
        let mm0 = mig_mps(0, mig0);
        let mm1 = mig_mps(1, mig1);
        let mut sim = Sim::new(&set);
        assert!(sim.allocate(mig0, BTreeMap::new()));
        assert!(!sim.allocate(&mps, cc("1Gi", "2")));
        assert!(!sim.allocate(&ts, cc("0", "0")));
        assert!(!sim.allocate(&mm0, cc("1Gi", "2")));
        assert!(sim.allocate(&mm1, cc("4Gi", "8")));
        assert!(sim.allocate(&mm1, cc("4Gi", "8")));
        assert!(!sim.allocate(mig1, BTreeMap::new()));
        let big = find(&devs, "gpu-0-mig-7g80gb-0");
        assert!(!sim.allocate(big, BTreeMap::new()));
    }

    #[test]
    fn time_slicing_excludes_mps_and_the_whole_gpu_on_a_gpu_without_mig() {
        let (g, set, devs) = built("l4-24gb");
        assert!(!g.spec.mig_capable);
        // No counter set from the slice builder: the plain set stands in, and
        // the whole GPU must consume it too.
        let mut whole = find(&devs, "gpu-0").clone();
        whole.consumes_counters = Some(consume_all(&set));
        let mps = MpsDeviceSpec::whole(&g, CAPS)
            .unwrap()
            .device(&g, consume_all(&set))
            .unwrap();
        let ts = time_slice_device(&g, consume_all(&set)).unwrap();
        let mut sim = Sim::new(&set);
        assert!(sim.allocate(&ts, cc("0", "0")));
        assert!(sim.allocate(&ts, cc("0", "0")));
        assert!(!sim.allocate(&mps, cc("1Gi", "2")));
        assert!(!sim.allocate(&whole, BTreeMap::new()));
        let mut sim = Sim::new(&set);
        assert!(sim.allocate(&whole, BTreeMap::new()));
        assert!(!sim.allocate(&ts, cc("0", "0")));
    }

    // === published by build_slices (SliceOptions::sharing) ===

    fn all_sharing() -> SharingOptions {
        SharingOptions {
            mps_caps: Some(CAPS),
            mps: true,
            timeslice: true,
            mig_mps: true,
        }
    }

    fn published(
        model: &str,
        count: u32,
        layout: KubeLayout,
        sharing: SharingOptions,
    ) -> Result<(Vec<CounterSet>, Vec<Device>), crate::slices::SliceError> {
        let gpus: Vec<NodeGpu> = simulated_node(model, count)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        let mut o = SliceOptions::new("node-1", layout);
        o.sharing = sharing;
        let slices = build_slices(&gpus, &o)?;
        let sets = slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .cloned()
            .collect();
        let devs = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .cloned()
            .collect();
        Ok((sets, devs))
    }

    #[test]
    fn hard_memory_is_published_per_gpu_and_never_on_mig_mps() {
        let client = MpsCapabilities {
            memory_limit: MemoryLimit::Client,
            ..CAPS
        };
        let mut gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 2)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        gpus[0].mps_memory_hard = true;
        let mut o = SliceOptions::new("node-1", KubeLayout::V135Plus);
        o.sharing = SharingOptions {
            mps_caps: Some(client),
            ..all_sharing()
        };
        let devs: Vec<Device> = build_slices(&gpus, &o)
            .unwrap()
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .cloned()
            .collect();
        let mem = |d: &Device| {
            d.attributes.as_ref().unwrap()["mpsMemoryLimit"]
                .string
                .clone()
                .unwrap()
        };
        assert_eq!(mem(find(&devs, "gpu-0-mps")), "hard");
        assert_eq!(mem(find(&devs, "gpu-1-mps")), "client");
        let mig_mps: Vec<&Device> = devs
            .iter()
            .filter(|d| d.name.starts_with("gpu-0-mig-") && d.name.ends_with("-mps"))
            .collect();
        assert!(!mig_mps.is_empty());
        for d in mig_mps {
            assert_eq!(mem(d), "client", "{}", d.name);
        }
    }

    #[test]
    fn every_model_and_count_publishes_valid_sharing_devices() {
        for m in crate::MODELS {
            for count in [1, 2, 8] {
                for layout in [KubeLayout::V135Plus, KubeLayout::V134] {
                    let ctx = format!("{} x{count} {layout:?}", m.key);
                    // build_slices validates its own output (devices per
                    // slice, allowMultipleAllocations with requestPolicy, ...).
                    let (sets, devs) = published(m.key, count, layout, all_sharing())
                        .unwrap_or_else(|e| panic!("{ctx}: {e:?}"));
                    let (_, plain) =
                        published(m.key, count, layout, SharingOptions::default()).unwrap();
                    for gi in 0..count {
                        let g = gpu(m.key);
                        let set = sets
                            .iter()
                            .find(|s| s.name == counter_set_name(gi))
                            .unwrap_or_else(|| panic!("{ctx}: no counter set for GPU {gi}"));
                        let whole = find(&devs, &format!("gpu-{gi}"));
                        let mps = find(&devs, &format!("gpu-{gi}-mps"));
                        let ts = find(&devs, &format!("gpu-{gi}-ts"));
                        // Charged once per device: exactly what the twin consumes.
                        assert_eq!(
                            whole.consumes_counters.as_ref(),
                            Some(&consume_all(set)),
                            "{ctx}"
                        );
                        assert_eq!(mps.consumes_counters, whole.consumes_counters, "{ctx}");
                        assert_eq!(ts.consumes_counters, whole.consumes_counters, "{ctx}");
                        for d in [mps, ts] {
                            assert_eq!(d.allow_multiple_allocations, Some(true), "{ctx}");
                        }
                        let mut mig_count = 0;
                        for p in &g.spec.profiles {
                            for pl in &p.placements {
                                let twin = crate::names::DeviceName::mig(gi, &p.name, pl.start)
                                    .unwrap()
                                    .to_string();
                                let twin = find(&devs, &twin);
                                let mm = devs
                                    .iter()
                                    .find(|d| d.name == format!("{}-mps", twin.name))
                                    .unwrap_or_else(|| {
                                        panic!("{ctx}: no MIG-MPS twin of {}", twin.name)
                                    });
                                assert_eq!(mm.consumes_counters, twin.consumes_counters, "{ctx}");
                                assert_eq!(mm.allow_multiple_allocations, Some(true), "{ctx}");
                                assert_eq!(twin.allow_multiple_allocations, None, "{ctx}");
                                mig_count += 1;
                            }
                        }
                        let of_gpu = |ds: &[Device]| {
                            ds.iter()
                                .filter(|d| {
                                    d.name == format!("gpu-{gi}")
                                        || d.name.starts_with(&format!("gpu-{gi}-"))
                                })
                                .count()
                        };
                        assert_eq!(of_gpu(&devs), 2 * mig_count + 3, "{ctx}");
                        assert_eq!(of_gpu(&plain), mig_count + 1, "{ctx}");
                    }
                    // Without sharing nothing shareable is published.
                    assert!(
                        plain.iter().all(|d| d.allow_multiple_allocations.is_none()),
                        "{ctx}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_sharing_kind_is_published_only_when_asked() {
        let names = |sharing| {
            let (_, devs) = published("a30-24gb", 1, KubeLayout::V135Plus, sharing).unwrap();
            devs.into_iter().map(|d| d.name).collect::<Vec<_>>()
        };
        let ts = names(SharingOptions {
            timeslice: true,
            ..Default::default()
        });
        assert!(ts.contains(&"gpu-0-ts".to_string()));
        assert!(!ts.iter().any(|n| n.ends_with("-mps")));
        let mps = names(SharingOptions {
            mps_caps: Some(CAPS),
            mps: true,
            ..Default::default()
        });
        assert_eq!(
            mps.iter()
                .filter(|n| n.ends_with("-mps"))
                .collect::<Vec<_>>(),
            ["gpu-0-mps"]
        );
        // MIG-MPS alone: no whole-GPU MPS device.
        let mig_only = names(SharingOptions {
            mps_caps: Some(CAPS),
            mig_mps: true,
            ..Default::default()
        });
        assert!(!mig_only.contains(&"gpu-0-mps".to_string()), "{mig_only:?}");
        assert!(
            mig_only
                .iter()
                .any(|n| n.contains("-mig-") && n.ends_with("-mps"))
        );
        // A MIG-MPS device comes right after its exclusive twin.
        let all = names(all_sharing());
        for (i, n) in all.iter().enumerate() {
            if let Some(twin) = n.strip_suffix("-mps").filter(|t| t.contains("-mig-")) {
                assert_eq!(all[i - 1], twin);
            }
        }
        // MIG-MPS without the node's MPS capabilities is refused by field.
        let e = published(
            "a30-24gb",
            1,
            KubeLayout::V135Plus,
            SharingOptions {
                mig_mps: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("sharing.mig_mps"), "{e}");
    }

    #[test]
    fn a_gpu_without_mig_gets_a_plain_counter_set_only_when_shared() {
        let (sets, devs) = published(
            "l4-24gb",
            2,
            KubeLayout::V135Plus,
            SharingOptions::default(),
        )
        .unwrap();
        assert!(sets.is_empty());
        assert!(devs.iter().all(|d| d.consumes_counters.is_none()));
        let (sets, devs) = published("l4-24gb", 2, KubeLayout::V134, all_sharing()).unwrap();
        let g = gpu("l4-24gb");
        assert_eq!(sets[0], plain_counter_set(&g));
        let mut sim = Sim::new(&sets[0]);
        assert!(sim.allocate(find(&devs, "gpu-0-ts"), cc("0", "0")));
        assert!(!sim.allocate(find(&devs, "gpu-0-mps"), cc("1Gi", "2")));
        assert!(!sim.allocate(find(&devs, "gpu-0"), BTreeMap::new()));
    }

    #[test]
    fn published_sharing_devices_exclude_each_other_on_every_mig_model() {
        for m in crate::MODELS.iter().filter(|m| m.spec().mig_capable) {
            let (sets, devs) = published(m.key, 1, KubeLayout::V135Plus, all_sharing()).unwrap();
            let set = &sets[0];
            let g = gpu(m.key);
            let small = &g.spec.profiles[0];
            let (p0, p1) = (small.placements[0].start, small.placements[1].start);
            let mig = |start| {
                crate::names::DeviceName::mig(0, &small.name, start)
                    .unwrap()
                    .to_string()
            };
            let (mig0, mig1) = (mig(p0), mig(p1));
            let (mm0, mm1) = (format!("{mig0}-mps"), format!("{mig1}-mps"));
            let share = |spec: &MpsDeviceSpec| {
                let r = spec.memory_range().unwrap();
                let s = spec.sm_range().unwrap();
                cc(&format!("{}Mi", r.min), &s.min.to_string())
            };
            let whole_spec = MpsDeviceSpec::whole(&g, CAPS).unwrap();
            let mig_spec = MpsDeviceSpec::mig(&g, &small.name, p0, CAPS).unwrap();
            // Whole-GPU MPS: shares coexist, everything else is excluded.
            let mut sim = Sim::new(set);
            for _ in 0..2 {
                assert!(
                    sim.allocate(find(&devs, "gpu-0-mps"), share(&whole_spec)),
                    "{}",
                    m.key
                );
            }
            let others = [
                ("gpu-0", BTreeMap::new()),
                ("gpu-0-ts", cc("0", "0")),
                (mig0.as_str(), BTreeMap::new()),
                (mm0.as_str(), share(&mig_spec)),
            ];
            for (other, req) in others {
                assert!(
                    !sim.allocate(find(&devs, other), req),
                    "{}: {other} after MPS",
                    m.key
                );
            }
            // MIG-MPS: two shares on one placement, the twin and the whole
            // GPU excluded, another placement still free.
            let mut sim = Sim::new(set);
            assert!(
                sim.allocate(find(&devs, &mm0), share(&mig_spec)),
                "{}",
                m.key
            );
            assert!(
                sim.allocate(find(&devs, &mm0), share(&mig_spec)),
                "{}",
                m.key
            );
            assert!(
                !sim.allocate(find(&devs, &mig0), BTreeMap::new()),
                "{}",
                m.key
            );
            assert!(
                !sim.allocate(find(&devs, "gpu-0"), BTreeMap::new()),
                "{}",
                m.key
            );
            assert!(
                !sim.allocate(find(&devs, "gpu-0-mps"), share(&whole_spec)),
                "{}",
                m.key
            );
            assert!(
                sim.allocate(find(&devs, &mm1), share(&mig_spec)),
                "{}",
                m.key
            );
            assert!(
                !sim.allocate(find(&devs, &mig1), BTreeMap::new()),
                "{}",
                m.key
            );
        }
    }
}
