//! The ResourceSlices a node publishes, built and validated here (sent by
//! carve-kube). Pure: builds `k8s-openapi` objects, does no I/O.
//!
//! Model (KEP-4815 partitionable devices): each MIG-capable GPU is one counter
//! set `gpu-<i>-counters` with a counter per memory slice plus compute slices,
//! multiprocessors, memory and engines; the whole GPU `gpu-<i>` consumes all of
//! it and every MIG placement (profile × start) is a device consuming its share,
//! so the scheduler can only co-allocate placements the hardware can hold.
//! GPUs that cannot do MIG publish only the whole device and no counter set:
//! nothing can partition them, and a device without counters is allowed in
//! every Kubernetes version and keeps its slice at the 128-device limit.
//!
//! Sharing devices (MPS `gpu-<i>-mps`, MIG-MPS `gpu-<i>-mig-<p>-<s>-mps`,
//! time-slice `gpu-<i>-ts`, built by [`crate::sharing`]) are published only
//! when [`SliceOptions::sharing`] asks; each consumes exactly what its exclusive
//! twin consumes (see [`crate::sharing`] on the charge-once rule). A GPU that
//! cannot do MIG then gets the plain counter set of
//! [`crate::sharing::plain_counter_set`], which its whole device consumes too.
//!
//! Not here: taints, health, publishing.

pub mod quantity;
mod sim;
mod summary;
mod validate;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::geometry::{Conflict, Instance, Occupancy, Totals, max_layout_totals};
use crate::names::{DeviceName, NameError, ProfileToken};
use crate::order::{DeviceOrder, nvidia_device_name, placement_order};
use crate::scheduler::{ShareLayout, SharedGpu};
use crate::sharing::{MpsCapabilities, MpsDeviceSpec, SharingError, time_slice_device};
use crate::spec::{GpuSpec, PhysicalGpu, SpecError};

pub use quantity::{Amount, QuantityError, parse_quantity};
pub use sim::{MAX_SIMULATED_GPUS, parse_gpu_spec, simulated_gpus, simulated_node};
pub use summary::{GpuSummary, summarize};
pub use validate::{
    KubeVersion, Rule, ValidationError, limits, taint_effects, taint_problem, validate_slices,
    validate_slices_for_version,
};

/// Label key naming the manager of a slice.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "carve";
/// Label key naming the node of a slice (value: [`node_label_value`]).
pub const NODE_LABEL: &str = "gpu.carve.dev/node";
/// Devices carve puts in one slice: the 1.35+ limit for counter-consuming
/// devices, also used for 1.34 (whose limit is 128) so one rule serves both.
pub const MAX_DEVICES_PER_SLICE: usize = 64;

/// Counter names of a GPU's counter set (besides `memory-slice-<k>`).
pub mod counters {
    /// Prefix of the per-memory-slice counters (`memory-slice-0`, ...), value 1.
    pub const MEMORY_SLICE_PREFIX: &str = "memory-slice-";
    /// Compute (SM) slices.
    pub const COMPUTE_SLICES: &str = "compute-slices";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    /// Device memory, bytes.
    pub const MEMORY: &str = "memory";
    /// Copy engines.
    pub const COPY_ENGINES: &str = "copy-engines";
    /// Video decoders.
    pub const DECODERS: &str = "decoders";
    /// Video encoders.
    pub const ENCODERS: &str = "encoders";
    /// JPEG decoders.
    pub const JPEG_ENGINES: &str = "jpeg-engines";
    /// Optical flow accelerators.
    pub const OFA_ENGINES: &str = "ofa-engines";
    /// Value 1; only present when the engine counters cannot keep media-extension
    /// (`+me`) instances exclusive by themselves.
    pub const MEDIA_EXTENSIONS: &str = "media-extensions";
}

/// Which `resource.k8s.io/v1` slice layout the API server accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KubeLayout {
    /// Kubernetes 1.34: counter sets in the same slice as their devices.
    V134,
    /// Kubernetes 1.35 and later: counter sets in their own slices.
    V135Plus,
}

impl KubeLayout {
    /// The layout for an API server version.
    ///
    /// # Errors
    /// [`SliceError::UnsupportedVersion`] before 1.34 (no `resource.k8s.io/v1`).
    pub fn for_version(major: u32, minor: u32) -> Result<Self, SliceError> {
        match (major, minor) {
            (1, 34) => Ok(Self::V134),
            (1, m) if m > 34 => Ok(Self::V135Plus),
            (m, _) if m > 1 => Ok(Self::V135Plus),
            _ => Err(SliceError::UnsupportedVersion {
                version: format!("{major}.{minor}"),
            }),
        }
    }

    /// The layout for the `major`/`minor` strings of `/version`, which some
    /// distributions suffix (`"35+"`).
    ///
    /// # Errors
    /// [`SliceError::UnsupportedVersion`] when they are not numbers or are before 1.34.
    pub fn from_version_info(major: &str, minor: &str) -> Result<Self, SliceError> {
        let num = |s: &str| -> Option<u32> {
            let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            s[..end].parse().ok()
        };
        match (num(major), num(minor)) {
            (Some(a), Some(b)) => Self::for_version(a, b),
            _ => Err(SliceError::UnsupportedVersion {
                version: format!("{major}.{minor}"),
            }),
        }
    }
}

/// How carve manages a GPU's MIG instances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuPolicy {
    /// carve creates instances on demand: publish every placement and the whole GPU.
    Dynamic,
    /// The instances are fixed: publish only them (or the whole GPU when there are none).
    Static {
        /// Existing instances as (profile name, placement start).
        instances: Vec<(String, u8)>,
    },
}

/// One GPU of the node and its policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeGpu {
    /// The GPU.
    pub gpu: PhysicalGpu,
    /// Its policy.
    pub policy: GpuPolicy,
    /// MIG mode is on and leaving it needs a GPU reset (Ampere): CUDA work runs
    /// only inside MIG instances, so neither the whole GPU nor its whole-GPU
    /// sharing devices (MPS, time-slice) are published, whatever the policy.
    pub mig_locked: bool,
    /// Its whole-GPU MPS device's memory limit is `hard`: memory
    /// partitioning holds on this GPU (detected by the plugin). Its MIG-MPS
    /// devices are never `hard` ([`MpsCapabilities::on_mig`]).
    pub mps_memory_hard: bool,
}

impl NodeGpu {
    /// A GPU with `policy` whose MIG mode is not locked on.
    #[must_use]
    pub fn new(gpu: PhysicalGpu, policy: GpuPolicy) -> Self {
        Self {
            gpu,
            policy,
            mig_locked: false,
            mps_memory_hard: false,
        }
    }

    /// A GPU carve partitions on demand ([`GpuPolicy::Dynamic`]).
    #[must_use]
    pub fn dynamic(gpu: PhysicalGpu) -> Self {
        Self::new(gpu, GpuPolicy::Dynamic)
    }
}

/// Which sharing devices a node publishes (default: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharingOptions {
    /// The enforcement the node's MPS setup has (published with every MPS
    /// device); needed by `mps` and `mig_mps`.
    pub mps_caps: Option<MpsCapabilities>,
    /// Publish `gpu-<i>-mps` for every GPU that shows its whole device.
    pub mps: bool,
    /// Publish `gpu-<i>-ts` for every GPU that shows its whole device.
    pub timeslice: bool,
    /// Publish `gpu-<i>-mig-<p>-<s>-mps` for every published MIG placement.
    pub mig_mps: bool,
}

impl SharingOptions {
    /// These options with the MPS memory limit `hard` (for a GPU where
    /// memory partitioning holds, [`NodeGpu::mps_memory_hard`]).
    #[must_use]
    pub fn with_hard_memory(self) -> Self {
        Self {
            mps_caps: self.mps_caps.map(|c| MpsCapabilities {
                memory_limit: crate::sharing::MemoryLimit::Hard,
                ..c
            }),
            ..self
        }
    }
}

/// Inputs of [`build_slices`] besides the GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceOptions {
    /// The node's name (`spec.nodeName`).
    pub node_name: String,
    /// Driver name, normally [`crate::DRIVER_NAME`].
    pub driver: String,
    /// Pool name, normally the node name.
    pub pool: String,
    /// Pool generation; bump on every change.
    pub generation: i64,
    /// Slice layout of the API server.
    pub layout: KubeLayout,
    /// Device order policy.
    pub order: DeviceOrder,
    /// Sharing devices to publish.
    pub sharing: SharingOptions,
    /// Whether sharing devices are published beside exclusive ones on every
    /// GPU, or only on some GPUs and apart ([`ShareLayout`]): set it from the
    /// scheduler's version ([`ShareLayout::for_scheduler`]).
    pub shares: ShareLayout,
}

impl SliceOptions {
    /// Options for `node` with carve's driver name, pool = node name,
    /// generation 0 and carve's device order.
    #[must_use]
    pub fn new(node: &str, layout: KubeLayout) -> Self {
        Self {
            node_name: node.to_string(),
            driver: crate::DRIVER_NAME.to_string(),
            pool: node.to_string(),
            generation: 0,
            layout,
            order: DeviceOrder::Carve,
            sharing: SharingOptions::default(),
            shares: ShareLayout::Mixed,
        }
    }
}

/// Why slices cannot be built. Nothing is built half-way.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    /// The API server is older than 1.34 or its version does not parse.
    #[error("Kubernetes {version} is not supported: resource.k8s.io/v1 needs 1.34 or later")]
    UnsupportedVersion {
        /// The version as given.
        version: String,
    },
    /// A [`SliceOptions`] field is invalid.
    #[error("slice option {field} = {value:?}: {rule}")]
    InvalidOption {
        /// Field name.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// A GPU named to host shares cannot host them as asked.
    #[error("GPU {gpu} ({product}) cannot host {kind} shares: {why}")]
    SharedGpu {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
        /// The kind asked for (`mps`, `timeslice`, `mig-mps:2g.20gb`).
        kind: String,
        /// Why not, and what would.
        why: String,
    },
    /// A GPU named to host shares is not on the node.
    #[error("GPU {gpu} is named to host shares but the node has no GPU {gpu} (its GPUs: {known})")]
    SharedGpuMissing {
        /// The index named.
        gpu: u32,
        /// The node's GPU indices, comma-separated.
        known: String,
    },
    /// Two GPUs have the same index.
    #[error("GPU index {index} appears twice")]
    DuplicateGpu {
        /// The index.
        index: u32,
    },
    /// The GPU's spec is inconsistent.
    #[error("GPU {gpu}: inconsistent spec")]
    Spec {
        /// GPU index.
        gpu: u32,
        /// What is inconsistent.
        #[source]
        source: SpecError,
    },
    /// A static instance names a profile the GPU does not have.
    #[error(
        "GPU {gpu} ({product}): static instance profile {profile:?} is unknown; known: {known}"
    )]
    UnknownProfile {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
        /// The profile.
        profile: String,
        /// The GPU's profiles, comma-separated.
        known: String,
    },
    /// A static policy lists instances on a GPU that cannot do MIG.
    #[error("GPU {gpu} ({product}) is not MIG-capable but its static policy lists instances")]
    StaticOnNonMig {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
    },
    /// Static instances are not a layout the hardware can hold.
    #[error("GPU {gpu}: static instance {profile} at start {start}")]
    StaticConflict {
        /// GPU index.
        gpu: u32,
        /// Profile.
        profile: String,
        /// Placement start.
        start: u8,
        /// Why it cannot be placed.
        #[source]
        source: Conflict,
    },
    /// A version string cannot be made semver.
    #[error("GPU {gpu}: {attribute} {value:?} is not a dotted numeric version")]
    BadVersion {
        /// GPU index.
        gpu: u32,
        /// Attribute name.
        attribute: &'static str,
        /// The value.
        value: String,
    },
    /// An identifying string attribute is longer than 64 bytes.
    #[error("GPU {gpu}: attribute {attribute} value {value:?} is longer than 64 bytes")]
    AttributeTooLong {
        /// GPU index.
        gpu: u32,
        /// Attribute name.
        attribute: &'static str,
        /// The value.
        value: String,
    },
    /// A profile name has no device-name form.
    #[error("GPU {gpu}: profile has no device name")]
    ProfileName {
        /// GPU index.
        gpu: u32,
        /// The naming error.
        #[source]
        source: NameError,
    },
    /// One GPU alone would exceed a slice limit.
    #[error("GPU {gpu} ({product}): rule {rule}: {detail}")]
    Limit {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
        /// The limit.
        rule: Rule,
        /// By how much.
        detail: String,
    },
    /// A sharing device of a GPU cannot be described.
    #[error("GPU {gpu}: sharing device")]
    Sharing {
        /// GPU index.
        gpu: u32,
        /// What is wrong.
        #[source]
        source: SharingError,
    },
    /// The built slices fail validation (a bug in carve; nothing is returned).
    #[error("built slices are invalid")]
    Invalid(#[source] ValidationError),
    /// A GPU model key is unknown.
    #[error("unknown GPU model {model:?}; known models: {known}")]
    UnknownModel {
        /// The key as given.
        model: String,
        /// Known keys, comma-separated.
        known: String,
    },
    /// A `model:count[,model:count]` list does not parse.
    #[error("GPU list {input:?}: {why}")]
    GpuListSyntax {
        /// The text.
        input: String,
        /// What is wrong.
        why: String,
    },
    /// A `model:count[,model:count]` list asks for more GPUs than one
    /// simulated node may have ([`MAX_SIMULATED_GPUS`]).
    #[error(
        "GPU list {input:?}: {total} GPUs on one node, more than the {max} a simulated node may have (a real node has at most 16)"
    )]
    TooManyGpus {
        /// The text.
        input: String,
        /// The GPUs it asks for, all models together.
        total: u64,
        /// The limit.
        max: u32,
    },
}

// === counter model ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Qty {
    Int(u64),
    Mib(u64),
}

impl Qty {
    fn quantity(self) -> Quantity {
        match self {
            Self::Int(v) => quantity::int(v),
            Self::Mib(v) => quantity::mebibytes(v),
        }
    }
    fn is_zero(self) -> bool {
        matches!(self, Self::Int(0) | Self::Mib(0))
    }
}

/// The counters of one GPU model and what each of its devices consumes: built
/// once per distinct spec in a build and shared by every GPU of that spec
/// (only the counter set name differs between them).
#[derive(Clone, Debug)]
struct ModelCounters {
    /// The counters of the set; the whole GPU consumes all of them.
    capacity: BTreeMap<String, Counter>,
    /// Per profile: (placement start, what a device at that placement consumes).
    mig: Vec<Vec<(u8, BTreeMap<String, Counter>)>>,
}

fn counters_of(list: impl IntoIterator<Item = (String, Qty)>) -> BTreeMap<String, Counter> {
    list.into_iter()
        .map(|(n, q)| {
            (
                n,
                Counter {
                    value: q.quantity(),
                },
            )
        })
        .collect()
}

impl ModelCounters {
    /// The counters of a MIG-capable GPU whose largest layouts reach `t`, and
    /// the consumption of every placement of every profile.
    fn new(spec: &GpuSpec, t: Totals) -> Self {
        use counters::*;
        let up = |a: u32, b: u32| u64::from(a.max(b));
        let mut capacity: Vec<(String, Qty)> = (0..spec.memory_slices)
            .map(|k| (format!("{MEMORY_SLICE_PREFIX}{k}"), Qty::Int(1)))
            .collect();
        let mut ofa = up(t.engines.ofa, spec.engines.ofa);
        // Raising OFA to the whole GPU's count must not admit two `+me` instances.
        let me_ofa = spec
            .profiles
            .iter()
            .filter(|p| p.media_extensions)
            .map(|p| u64::from(p.engines.ofa))
            .min();
        if me_ofa.is_some_and(|m| 2 * m <= ofa) {
            ofa = u64::from(t.engines.ofa);
        }
        let media_counter = me_ofa.is_some_and(|m| 2 * m <= ofa);
        capacity.extend([
            (
                COMPUTE_SLICES.to_string(),
                Qty::Int(up(t.compute_slices, u32::from(spec.compute_slices))),
            ),
            (
                MULTIPROCESSORS.to_string(),
                Qty::Int(up(t.multiprocessors, spec.multiprocessors)),
            ),
            (
                MEMORY.to_string(),
                Qty::Mib(t.memory_mib.max(spec.memory_mib)),
            ),
            (
                COPY_ENGINES.to_string(),
                Qty::Int(up(t.engines.copy, spec.engines.copy)),
            ),
            (
                DECODERS.to_string(),
                Qty::Int(up(t.engines.decoders, spec.engines.decoders)),
            ),
            (
                ENCODERS.to_string(),
                Qty::Int(up(t.engines.encoders, spec.engines.encoders)),
            ),
            (
                JPEG_ENGINES.to_string(),
                Qty::Int(up(t.engines.jpeg, spec.engines.jpeg)),
            ),
            (OFA_ENGINES.to_string(), Qty::Int(ofa)),
        ]);
        if media_counter {
            capacity.push((MEDIA_EXTENSIONS.to_string(), Qty::Int(1)));
        }
        capacity.retain(|(_, q)| !q.is_zero());
        let capacity = counters_of(capacity);
        let mig = spec
            .profiles
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                p.placements
                    .iter()
                    .map(|pl| (pl.start, mig_consumption(&capacity, spec, pi, pl.start)))
                    .collect()
            })
            .collect();
        Self { capacity, mig }
    }

    /// The counter set of a GPU without MIG that publishes sharing devices:
    /// what [`crate::sharing::plain_counter_set`] describes.
    fn plain(spec: &GpuSpec) -> Self {
        Self {
            capacity: counters_of([
                (counters::MEMORY.to_string(), Qty::Mib(spec.memory_mib)),
                (
                    counters::MULTIPROCESSORS.to_string(),
                    Qty::Int(spec.multiprocessors.into()),
                ),
            ]),
            mig: Vec::new(),
        }
    }
}

/// What a MIG device of `profile` at `start` consumes of a counter set with
/// `capacity`: its memory slices and its share of every other counter the set
/// has (zero shares left out).
fn mig_consumption(
    capacity: &BTreeMap<String, Counter>,
    spec: &GpuSpec,
    profile: usize,
    start: u8,
) -> BTreeMap<String, Counter> {
    use counters::*;
    let p = &spec.profiles[profile];
    let mut want: Vec<(String, Qty)> = (start..start + p.memory_slices)
        .map(|k| (format!("{MEMORY_SLICE_PREFIX}{k}"), Qty::Int(1)))
        .collect();
    let e = p.engines;
    want.extend([
        (
            COMPUTE_SLICES.to_string(),
            Qty::Int(p.compute_slices.into()),
        ),
        (
            MULTIPROCESSORS.to_string(),
            Qty::Int(p.multiprocessors.into()),
        ),
        (MEMORY.to_string(), Qty::Mib(p.memory_mib)),
        (COPY_ENGINES.to_string(), Qty::Int(e.copy.into())),
        (DECODERS.to_string(), Qty::Int(e.decoders.into())),
        (ENCODERS.to_string(), Qty::Int(e.encoders.into())),
        (JPEG_ENGINES.to_string(), Qty::Int(e.jpeg.into())),
        (OFA_ENGINES.to_string(), Qty::Int(e.ofa.into())),
        (
            MEDIA_EXTENSIONS.to_string(),
            Qty::Int(u64::from(p.media_extensions)),
        ),
    ]);
    counters_of(
        want.into_iter()
            .filter(|(n, q)| !q.is_zero() && capacity.contains_key(n)),
    )
}

/// Specs whose [`ModelCounters`] a build of this process already worked out,
/// most recent last. The counters are a pure function of the spec, and working
/// them out enumerates every layout of the model (the costliest step of a
/// build), so the plugin's rebuilds (a health change, a new generation) reuse
/// them instead of enumerating again. Bounded: a node has a few GPU models.
static MODEL_COUNTERS: Mutex<Vec<(GpuSpec, Arc<ModelCounters>)>> = Mutex::new(Vec::new());
/// Specs [`MODEL_COUNTERS`] keeps.
const MODEL_COUNTERS_KEPT: usize = 8;

/// The counters of `spec` (a MIG-capable spec or one publishing sharing
/// devices), from [`MODEL_COUNTERS`] or worked out and kept there.
fn model_counters(spec: &GpuSpec) -> Arc<ModelCounters> {
    let cached = |cache: &[(GpuSpec, Arc<ModelCounters>)]| {
        cache
            .iter()
            .find(|(s, _)| s == spec)
            .map(|(_, c)| Arc::clone(c))
    };
    // A panic while the lock was held cannot leave a half-made entry (entries
    // are pushed whole), so a poisoned cache is still sound.
    if let Some(c) = cached(
        &MODEL_COUNTERS
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    ) {
        return c;
    }
    // Worked out without the lock: concurrent builds of a new model may both
    // compute it, and the first one kept wins.
    let made = Arc::new(if spec.mig_capable {
        ModelCounters::new(spec, max_layout_totals(spec))
    } else {
        ModelCounters::plain(spec)
    });
    let mut cache = MODEL_COUNTERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = cached(&cache) {
        return c;
    }
    if cache.len() >= MODEL_COUNTERS_KEPT {
        cache.remove(0);
    }
    cache.push((spec.clone(), Arc::clone(&made)));
    made
}

/// The counter set of one GPU: its name and its model's counters.
#[derive(Clone, Debug)]
struct CounterModel<'m> {
    set: String,
    counters: &'m ModelCounters,
}

impl CounterModel<'_> {
    fn counters_len(&self) -> usize {
        self.counters.capacity.len()
    }

    fn counter_set(&self) -> CounterSet {
        CounterSet {
            name: self.set.clone(),
            counters: self.counters.capacity.clone(),
        }
    }

    // `..Default::default()` is needed with k8s-openapi's v1_37 feature, which
    // adds `compatibility_groups`.
    #[allow(clippy::needless_update)]
    fn consumption(&self, counters: BTreeMap<String, Counter>) -> Vec<DeviceCounterConsumption> {
        vec![DeviceCounterConsumption {
            counter_set: self.set.clone(),
            counters,
            ..Default::default()
        }]
    }

    fn whole(&self) -> Vec<DeviceCounterConsumption> {
        self.consumption(self.counters.capacity.clone())
    }

    fn mig(&self, spec: &GpuSpec, profile: usize, start: u8) -> Vec<DeviceCounterConsumption> {
        let known = self
            .counters
            .mig
            .get(profile)
            .and_then(|starts| starts.iter().find(|(s, _)| *s == start));
        self.consumption(match known {
            Some((_, c)) => c.clone(),
            // Not a listed placement of the profile: work it out.
            None => mig_consumption(&self.counters.capacity, spec, profile, start),
        })
    }
}

/// The counter set name of GPU `index`: `gpu-<index>-counters`.
#[must_use]
pub fn counter_set_name(index: u32) -> String {
    format!("gpu-{index}-counters")
}

/// Whether `devices` together consume no more of `set` than it holds: the
/// scheduler's question when it co-allocates them. Entries for other counter
/// sets are ignored; a consumed counter the set lacks does not fit.
///
/// # Errors
/// A quantity that does not parse.
pub fn consumption_fits(set: &CounterSet, devices: &[&Device]) -> Result<bool, QuantityError> {
    let mut used: BTreeMap<&str, Amount> = BTreeMap::new();
    for d in devices {
        for cc in d.consumes_counters.iter().flatten() {
            if cc.counter_set != set.name {
                continue;
            }
            for (k, v) in &cc.counters {
                let a = quantity::parse(&v.value)?;
                let e = used.entry(k.as_str()).or_default();
                *e = e.checked_add(a).ok_or_else(|| QuantityError::OutOfRange {
                    input: v.value.0.clone(),
                })?;
            }
        }
    }
    for (k, u) in used {
        let Some(c) = set.counters.get(k) else {
            return Ok(false);
        };
        if u > quantity::parse(&c.value)? {
            return Ok(false);
        }
    }
    Ok(true)
}

// === device plan and order ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Whole,
    Mig {
        profile: usize,
        start: u8,
    },
    /// MPS on the whole GPU.
    Mps,
    /// Time-sliced whole GPU.
    TimeSlice,
    /// MPS on a MIG placement.
    MigMps {
        profile: usize,
        start: u8,
    },
}

impl Kind {
    /// 0 exclusive, 1 MPS, 2 time-slice: orders a unit after its exclusive twin.
    fn sharing_rank(self) -> u8 {
        match self {
            Self::Whole | Self::Mig { .. } => 0,
            Self::Mps | Self::MigMps { .. } => 1,
            Self::TimeSlice => 2,
        }
    }
}

/// Whether a sharing unit can be described (an instance too small for one MPS
/// share plus a step is left out, not an error).
fn shareable(r: Result<MpsDeviceSpec, SharingError>, gpu: u32) -> Result<bool, SliceError> {
    match r {
        Ok(_) => Ok(true),
        Err(SharingError::TooSmall { .. }) => Ok(false),
        Err(source) => Err(SliceError::Sharing { gpu, source }),
    }
}

/// `units` plus the sharing devices `sharing` asks for: MIG-MPS after each MIG
/// placement, MPS and time-slice after the whole GPU.
fn with_sharing(
    g: &NodeGpu,
    units: Vec<Kind>,
    sharing: &SharingOptions,
) -> Result<Vec<Kind>, SliceError> {
    let gpu = &g.gpu;
    let mut out = Vec::with_capacity(units.len() * 2 + 2);
    for k in units {
        out.push(k);
        match (k, sharing.mps_caps) {
            (Kind::Mig { profile, start }, Some(caps)) if sharing.mig_mps => {
                let name = &gpu.spec.profiles[profile].name;
                if shareable(MpsDeviceSpec::mig(gpu, name, start, caps), gpu.index)? {
                    out.push(Kind::MigMps { profile, start });
                }
            }
            (Kind::Whole, mps) => {
                if let Some(caps) = mps.filter(|_| sharing.mps)
                    && shareable(MpsDeviceSpec::whole(gpu, caps), gpu.index)?
                {
                    out.push(Kind::Mps);
                }
                if sharing.timeslice {
                    out.push(Kind::TimeSlice);
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// `kinds` (from [`with_sharing`]) as `shares` lets GPU `g` publish them:
/// all of them ([`ShareLayout::Mixed`]); or, apart, only the exclusive ones
/// on a GPU not listed, and only the listed kind on a listed GPU, on units
/// that do not overlap (MIG-MPS: placements of the profile by start, each
/// kept while the instances kept so far and it can coexist on the GPU).
fn apart(
    g: &NodeGpu,
    kinds: Vec<Kind>,
    shares: &ShareLayout,
    sharing: &SharingOptions,
) -> Result<Vec<Kind>, SliceError> {
    let ShareLayout::Separate(listed) = shares else {
        return Ok(kinds);
    };
    let gpu = &g.gpu;
    let Some(kind) = listed.get(&gpu.index) else {
        return Ok(kinds
            .into_iter()
            .filter(|k| k.sharing_rank() == 0)
            .collect());
    };
    let refuse = |why: String| SliceError::SharedGpu {
        gpu: gpu.index,
        product: gpu.spec.product_name.clone(),
        kind: kind.to_string(),
        why,
    };
    let (on, flag) = match kind {
        SharedGpu::Mps => (sharing.mps, "mps"),
        SharedGpu::Timeslice => (sharing.timeslice, "timeslice"),
        SharedGpu::MigMps { .. } => (sharing.mig_mps, "mig-mps"),
    };
    if !on {
        return Err(refuse(format!(
            "the node's sharing does not include {flag} (add it to --sharing, or the chart's sharing settings)"
        )));
    }
    let kept: Vec<Kind> = match kind {
        SharedGpu::Mps => kinds.into_iter().filter(|k| *k == Kind::Mps).collect(),
        SharedGpu::Timeslice => kinds
            .into_iter()
            .filter(|k| *k == Kind::TimeSlice)
            .collect(),
        SharedGpu::MigMps { profile } => {
            let spec = &gpu.spec;
            let Some(pi) = spec.profiles.iter().position(|p| &p.name == profile) else {
                let known = spec
                    .profiles
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>();
                return Err(refuse(if known.is_empty() {
                    "it has no MIG profiles".to_string()
                } else {
                    format!(
                        "it has no profile {profile:?}; its profiles: {}",
                        known.join(", ")
                    )
                }));
            };
            let mut starts: Vec<u8> = kinds
                .iter()
                .filter_map(|k| match *k {
                    Kind::MigMps { profile, start } if profile == pi => Some(start),
                    _ => None,
                })
                .collect();
            starts.sort_unstable();
            let mut occ = Occupancy::new(spec);
            starts.retain(|&start| occ.place(Instance { profile: pi, start }).is_ok());
            kinds
                .into_iter()
                .filter(|k| matches!(*k, Kind::MigMps { profile, start } if profile == pi && starts.contains(&start)))
                .collect()
        }
    };
    if kept.is_empty() {
        let why = match kind {
            SharedGpu::Mps | SharedGpu::Timeslice if g.mig_locked && gpu.spec.mig_capable => {
                "its MIG mode is on and needs a GPU reset to change, so it publishes no whole GPU (name it mig-mps:PROFILE instead)".to_string()
            }
            SharedGpu::Mps => "it publishes no whole-GPU MPS device (static MIG instances, or too small for a share)".to_string(),
            SharedGpu::Timeslice => "it publishes no whole GPU (static MIG instances)".to_string(),
            SharedGpu::MigMps { .. } => "it publishes no MIG-MPS device of that profile (MIG off and locked, static instances of other profiles, or instances too small for a share)".to_string(),
        };
        return Err(refuse(why));
    }
    Ok(kept)
}

#[derive(Clone, Debug)]
struct Planned {
    gpu: usize,
    kind: Kind,
    name: DeviceName,
}

/// What ordering and naming the devices of one spec needs, worked out once
/// per distinct (validated) spec of a node.
struct SpecOrder {
    /// Per profile: its starts in the policy's order ([`placement_order`]).
    starts: Vec<Vec<u8>>,
    /// Per profile: (start, tier, position in [`crate::order::carve_rank`]),
    /// the Carve policy key without the GPU (empty for other policies).
    carve: Vec<Vec<(u8, u8, usize)>>,
    /// Per profile: its device-name token.
    tokens: Vec<Result<ProfileToken, NameError>>,
}

impl SpecOrder {
    fn new(spec: &GpuSpec, order: DeviceOrder) -> Self {
        let profiles = 0..spec.profiles.len();
        let carve = match order {
            DeviceOrder::Carve => profiles
                .clone()
                .map(|pi| {
                    let size = spec.profiles[pi].memory_slices;
                    crate::order::carve_rank(spec, pi)
                        .into_iter()
                        .enumerate()
                        .map(|(rank, start)| {
                            let tier = crate::order::placement_tier(
                                spec,
                                pi,
                                crate::spec::Placement::new(start, size),
                            );
                            (start, tier, rank)
                        })
                        .collect()
                })
                .collect(),
            DeviceOrder::FirstFit | DeviceOrder::Name => Vec::new(),
        };
        Self {
            starts: profiles
                .clone()
                .map(|pi| placement_order(spec, pi, order))
                .collect(),
            carve,
            tokens: spec
                .profiles
                .iter()
                .map(|p| {
                    ProfileToken::from_profile_name(&p.name).ok_or_else(|| NameError {
                        name: p.name.clone(),
                        why: "profile name has no DNS-label form",
                    })
                })
                .collect(),
        }
    }

    /// The Carve policy key of a placement on GPU `index`: as
    /// [`crate::order::carve_device_key`].
    fn carve_key(&self, spec: &GpuSpec, profile: usize, index: u32, start: u8) -> (u8, u32, usize) {
        match self.carve[profile].iter().find(|(s, _, _)| *s == start) {
            Some(&(_, tier, rank)) => (tier, index, rank),
            None => (
                crate::order::placement_tier(
                    spec,
                    profile,
                    crate::spec::Placement::new(start, spec.profiles[profile].memory_slices),
                ),
                index,
                usize::MAX,
            ),
        }
    }
}

/// The units a GPU publishes: every placement (dynamic) or the static
/// instances, and the whole GPU (dynamic, or static without instances) unless
/// its MIG mode is locked on. Checks the static layout; the spec is checked by
/// the caller.
fn gpu_units(g: &NodeGpu, so: &SpecOrder) -> Result<Vec<Kind>, SliceError> {
    let mut units = mig_units(g, so)?;
    let whole = match &g.policy {
        GpuPolicy::Dynamic => true,
        GpuPolicy::Static { instances } => instances.is_empty(),
    };
    if whole && !(g.mig_locked && g.gpu.spec.mig_capable) {
        units.push(Kind::Whole);
    }
    Ok(units)
}

/// The MIG instances of [`gpu_units`].
fn mig_units(g: &NodeGpu, so: &SpecOrder) -> Result<Vec<Kind>, SliceError> {
    let gpu = g.gpu.index;
    let spec = &g.gpu.spec;
    let product = || spec.product_name.clone();
    let ranked = |profile: usize| so.starts[profile].iter().copied();
    match &g.policy {
        GpuPolicy::Dynamic => {
            let mut units = Vec::new();
            if spec.mig_capable {
                for pi in 0..spec.profiles.len() {
                    units.extend(ranked(pi).map(|start| Kind::Mig { profile: pi, start }));
                }
            }
            Ok(units)
        }
        GpuPolicy::Static { instances } if instances.is_empty() => Ok(Vec::new()),
        GpuPolicy::Static { instances } => {
            if !spec.mig_capable {
                return Err(SliceError::StaticOnNonMig {
                    gpu,
                    product: product(),
                });
            }
            let mut occ = Occupancy::new(spec);
            let mut insts = Vec::new();
            for (name, start) in instances {
                let Some(profile) = spec.profiles.iter().position(|p| &p.name == name) else {
                    return Err(SliceError::UnknownProfile {
                        gpu,
                        product: product(),
                        profile: name.clone(),
                        known: spec
                            .profiles
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                };
                let inst = Instance {
                    profile,
                    start: *start,
                };
                occ.place(inst)
                    .map_err(|source| SliceError::StaticConflict {
                        gpu,
                        profile: name.clone(),
                        start: *start,
                        source,
                    })?;
                insts.push(inst);
            }
            let mut units = Vec::new();
            for pi in 0..spec.profiles.len() {
                for start in ranked(pi) {
                    if insts.contains(&Instance { profile: pi, start }) {
                        units.push(Kind::Mig { profile: pi, start });
                    }
                }
            }
            Ok(units)
        }
    }
}

fn plan(
    gpus: &[NodeGpu],
    order: DeviceOrder,
    sharing: &SharingOptions,
    shares: &ShareLayout,
) -> Result<Vec<Planned>, SliceError> {
    let mut seen = std::collections::BTreeSet::new();
    for g in gpus {
        if !seen.insert(g.gpu.index) {
            return Err(SliceError::DuplicateGpu { index: g.gpu.index });
        }
    }
    if let ShareLayout::Separate(listed) = shares
        && let Some(&gpu) = listed.keys().find(|i| !seen.contains(i))
    {
        return Err(SliceError::SharedGpuMissing {
            gpu,
            known: seen
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    // (whole?, memory slices, compute slices, profile name, policy key,
    // sharing rank) where the policy key orders the devices of one profile
    // across the node and the sharing rank puts a sharing device right after
    // its exclusive twin.
    type Key<'a> = (bool, u8, u8, &'a str, (u8, u32, usize), u8);
    // Spec checks, placement orders, ranks and name tokens: once per distinct spec.
    let mut orders: Vec<(&GpuSpec, SpecOrder)> = Vec::new();
    // Per GPU: its spec's entry in `orders` and its devices.
    let mut units = Vec::with_capacity(gpus.len());
    for g in gpus {
        let spec = &g.gpu.spec;
        let oi = match orders.iter().position(|(s, _)| *s == spec) {
            Some(oi) => oi,
            None => {
                spec.validate().map_err(|source| SliceError::Spec {
                    gpu: g.gpu.index,
                    source,
                })?;
                orders.push((spec, SpecOrder::new(spec, order)));
                orders.len() - 1
            }
        };
        let kinds = with_sharing(g, gpu_units(g, &orders[oi].1)?, sharing)?;
        units.push((oi, apart(g, kinds, shares, sharing)?));
    }
    // Sized once: regrowing a list of this many large entries costs more than
    // building it.
    let mut all: Vec<(Key<'_>, String, Planned)> =
        Vec::with_capacity(units.iter().map(|(_, k)| k.len()).sum());
    for (gi, (g, (oi, kinds))) in gpus.iter().zip(units).enumerate() {
        let index = g.gpu.index;
        let spec = &g.gpu.spec;
        let so = &orders[oi].1;
        for kind in kinds {
            let rank = kind.sharing_rank();
            let (key, nvidia_name, name) = match kind {
                Kind::Whole | Kind::Mps | Kind::TimeSlice => (
                    (true, 0, 0, "", (0, index, 0), rank),
                    match kind {
                        Kind::Mps => format!("gpu-{index}-mps"),
                        Kind::TimeSlice => format!("gpu-{index}-ts"),
                        _ => format!("gpu-{index}"),
                    },
                    match kind {
                        Kind::Mps => DeviceName::Mps { gpu: index },
                        Kind::TimeSlice => DeviceName::TimeSlice { gpu: index },
                        _ => DeviceName::Gpu { gpu: index },
                    },
                ),
                Kind::Mig { profile, start } | Kind::MigMps { profile, start } => {
                    let p = &spec.profiles[profile];
                    let token = so.tokens[profile]
                        .clone()
                        .map_err(|source| SliceError::ProfileName { gpu: index, source })?;
                    let name = if rank == 1 {
                        DeviceName::MigMps {
                            gpu: index,
                            profile: token,
                            start,
                        }
                    } else {
                        DeviceName::Mig {
                            gpu: index,
                            profile: token,
                            start,
                        }
                    };
                    let policy = match order {
                        // Same key as `order::carve_device_key`, computed once per spec.
                        DeviceOrder::Carve => so.carve_key(spec, profile, index, start),
                        DeviceOrder::FirstFit | DeviceOrder::Name => (0, index, usize::from(start)),
                    };
                    (
                        (
                            false,
                            p.memory_slices,
                            p.compute_slices,
                            p.name.as_str(),
                            policy,
                            rank,
                        ),
                        if order == DeviceOrder::Name {
                            let n = nvidia_device_name(spec, index, profile, start);
                            if rank == 1 { format!("{n}-mps") } else { n }
                        } else {
                            String::new()
                        },
                        name,
                    )
                }
            };
            all.push((
                key,
                nvidia_name,
                Planned {
                    gpu: gi,
                    kind,
                    name,
                },
            ));
        }
    }
    match order {
        DeviceOrder::Name => all.sort_by(|a, b| a.1.cmp(&b.1)),
        DeviceOrder::FirstFit | DeviceOrder::Carve => all.sort_by(|a, b| a.0.cmp(&b.0)),
    }
    Ok(all.into_iter().map(|(_, _, p)| p).collect())
}

/// The order in which carve publishes the devices of `gpus`.
///
/// For [`DeviceOrder::FirstFit`] and [`DeviceOrder::Carve`]: MIG devices
/// profile-major from the smallest profile to the largest (memory slices, then
/// compute slices, then profile name); within a profile, FirstFit goes by GPU
/// index then start, Carve by [`carve_device_key`] (tier, GPU, rank), so the
/// devices of one profile come in the order of
/// [`crate::order::node_device_order`]; whole GPUs last, by index. The
/// scheduler takes the first device that fits, so small partitions land where
/// the policy wants them. For [`DeviceOrder::Name`]: sorted as strings by the
/// NVIDIA-style name ([`nvidia_device_name`]; `gpu-<i>` for whole GPUs), like
/// NVIDIA's driver. Static GPUs contribute only their instances.
///
/// # Errors
/// As [`build_slices`] for a GPU's spec or static instances.
pub fn device_order(gpus: &[NodeGpu], order: DeviceOrder) -> Result<Vec<DeviceName>, SliceError> {
    Ok(
        plan(gpus, order, &SharingOptions::default(), &ShareLayout::Mixed)?
            .into_iter()
            .map(|p| p.name)
            .collect(),
    )
}

// === attributes ===

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
fn a_bool(v: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(v),
        ..Default::default()
    }
}
fn a_version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

/// A dotted numeric version as semver: leading zeros dropped, padded to three
/// parts (`580.65.06` → `580.65.6`, `9.0` → `9.0.0`); parts beyond the third
/// become build metadata (`1.2.3.4` → `1.2.3+4`). `None` if not dotted numbers.
#[must_use]
pub fn semver_of(raw: &str) -> Option<String> {
    let parts: Vec<&str> = raw.trim().split('.').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    let mut nums: Vec<String> = parts
        .iter()
        .take(3)
        .map(|p| p.parse::<u64>().map(|n| n.to_string()))
        .collect::<Result<_, _>>()
        .ok()?;
    while nums.len() < 3 {
        nums.push("0".into());
    }
    let mut v = nums.join(".");
    if parts.len() > 3 {
        v.push('+');
        v.push_str(&parts[3..].join("."));
    }
    Some(v)
}

/// Truncate to at most 64 bytes on a character boundary.
fn clip64(s: &str) -> String {
    let mut end = s.len().min(limits::ATTRIBUTE_STRING_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Attributes shared by every device of a GPU.
fn common_attributes(gpu: &PhysicalGpu) -> Result<BTreeMap<String, DeviceAttribute>, SliceError> {
    let spec = &gpu.spec;
    let index = gpu.index;
    let checked = |attribute: &'static str, v: &str| {
        if v.len() > limits::ATTRIBUTE_STRING_BYTES {
            Err(SliceError::AttributeTooLong {
                gpu: index,
                attribute,
                value: v.to_string(),
            })
        } else {
            Ok(a_str(v))
        }
    };
    let (cc_major, cc_minor) = spec.cuda_compute_capability;
    let driver = semver_of(&gpu.driver_version).ok_or_else(|| SliceError::BadVersion {
        gpu: index,
        attribute: "driverVersion",
        value: gpu.driver_version.clone(),
    })?;
    let mut a = BTreeMap::new();
    // A product name is descriptive; clip it rather than refuse the GPU.
    a.insert("productName".into(), a_str(clip64(&spec.product_name)));
    a.insert("architecture".into(), a_str(spec.architecture.as_str()));
    a.insert("index".into(), a_int(gpu.index));
    a.insert("minor".into(), a_int(gpu.minor));
    a.insert("migCapable".into(), a_bool(spec.mig_capable));
    a.insert(
        "cudaComputeCapability".into(),
        a_version(format!("{cc_major}.{cc_minor}.0")),
    );
    a.insert("driverVersion".into(), a_version(driver));
    if spec.mig_capable {
        a.insert("computeSlices".into(), a_int(spec.compute_slices));
    }
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

fn capacity(memory_mib: u64, multiprocessors: u32) -> BTreeMap<String, DeviceCapacity> {
    BTreeMap::from([
        (
            "memory".to_string(),
            DeviceCapacity {
                value: quantity::mebibytes(memory_mib),
                ..Default::default()
            },
        ),
        (
            "multiprocessors".to_string(),
            DeviceCapacity {
                value: quantity::int(multiprocessors.into()),
                ..Default::default()
            },
        ),
    ])
}

/// Per GPU, what its devices share, made once: the common attributes and, per
/// profile on first use, a MIG device's attributes (`placementStart` still 0)
/// and capacity. Each MIG device gets a copy of its profile's parts, except the
/// profile's last device, which takes them: no parts are made only to be dropped.
struct GpuParts {
    common: BTreeMap<String, DeviceAttribute>,
    mig: Vec<Option<MigParts>>,
    /// Per profile, MIG devices still to be made.
    mig_left: Vec<u32>,
}

/// The attribute holding a MIG device's placement start.
const PLACEMENT_START: &str = "placementStart";

type MigParts = (
    BTreeMap<String, DeviceAttribute>,
    BTreeMap<String, DeviceCapacity>,
);

impl GpuParts {
    /// `mig_left[p]`: how many MIG devices of profile `p` will be made.
    fn new(gpu: &PhysicalGpu, mig_left: Vec<u32>) -> Result<Self, SliceError> {
        Ok(Self {
            common: common_attributes(gpu)?,
            mig: vec![None; gpu.spec.profiles.len()],
            mig_left,
        })
    }

    /// The parts of one more MIG device of `profile`.
    fn mig_device(&mut self, spec: &GpuSpec, profile: usize) -> MigParts {
        let prof = &spec.profiles[profile];
        let left = &mut self.mig_left[profile];
        *left = left.saturating_sub(1);
        if *left == 0 {
            return self.mig[profile]
                .take()
                .unwrap_or_else(|| mig_parts(&self.common, prof));
        }
        let common = &self.common;
        let (attrs, caps) = self.mig[profile].get_or_insert_with(|| mig_parts(common, prof));
        (attrs.clone(), caps.clone())
    }
}

/// A MIG device's attributes (`placementStart` still 0) and capacity.
fn mig_parts(common: &BTreeMap<String, DeviceAttribute>, prof: &crate::MigProfile) -> MigParts {
    let mut attrs = common.clone();
    if let Some(u) = attrs.remove("uuid") {
        attrs.insert("parentUUID".into(), u);
    }
    attrs.insert("type".into(), a_str("mig"));
    attrs.insert("profile".into(), a_str(prof.name.clone()));
    attrs.insert("memorySlices".into(), a_int(prof.memory_slices));
    attrs.insert("computeSlices".into(), a_int(prof.compute_slices));
    // Set per device; present here so that a device's copy only
    // changes a value (no insert into a cloned map).
    attrs.insert(PLACEMENT_START.into(), a_int(0));
    (attrs, capacity(prof.memory_mib, prof.multiprocessors))
}

/// A device name as a String sized for it once: `to_string` would regrow it
/// about three times while formatting.
fn device_name(n: &DeviceName) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(32);
    let _ = write!(s, "{n}");
    s
}

fn make_device(
    p: &Planned,
    gpu: &PhysicalGpu,
    parts: &mut GpuParts,
    model: Option<&CounterModel<'_>>,
    sharing: &SharingOptions,
) -> Result<Device, SliceError> {
    let spec = &gpu.spec;
    let shared = |r: Result<Device, SharingError>| {
        r.map_err(|source| SliceError::Sharing {
            gpu: gpu.index,
            source,
        })
    };
    let consumes = |c: Option<Vec<DeviceCounterConsumption>>| c.unwrap_or_default();
    let caps = || {
        sharing.mps_caps.ok_or_else(|| SliceError::InvalidOption {
            field: "sharing.mps_caps",
            value: "None".into(),
            rule: "MPS devices need the node's MPS capabilities".into(),
        })
    };
    Ok(match p.kind {
        Kind::Mps => shared(
            MpsDeviceSpec::whole(gpu, caps()?)
                .and_then(|m| m.device(gpu, consumes(model.map(CounterModel::whole)))),
        )?,
        Kind::TimeSlice => shared(time_slice_device(
            gpu,
            consumes(model.map(CounterModel::whole)),
        ))?,
        Kind::MigMps { profile, start } => shared(
            MpsDeviceSpec::mig(gpu, &spec.profiles[profile].name, start, caps()?)
                .and_then(|m| m.device(gpu, consumes(model.map(|c| c.mig(spec, profile, start))))),
        )?,
        Kind::Whole => {
            let mut attrs = parts.common.clone();
            attrs.insert("type".into(), a_str("gpu"));
            Device {
                name: device_name(&p.name),
                attributes: Some(attrs),
                capacity: Some(capacity(spec.memory_mib, spec.multiprocessors)),
                consumes_counters: model.map(CounterModel::whole),
                ..Default::default()
            }
        }
        Kind::Mig { profile, start } => {
            let (mut attrs, caps) = parts.mig_device(spec, profile);
            if let Some(a) = attrs.get_mut(PLACEMENT_START) {
                a.int = Some(start.into());
            }
            Device {
                name: device_name(&p.name),
                attributes: Some(attrs),
                capacity: Some(caps),
                consumes_counters: model.map(|m| m.mig(spec, profile, start)),
                ..Default::default()
            }
        }
    })
}

// === names and labels ===

/// 64-bit FNV-1a, for stable short suffixes of over-long names.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Longest `<node>-<driver>` prefix of a slice name: leaves room for
/// `-counters-` and a ten-digit number within 253.
const MAX_PREFIX: usize = 233;

/// The DNS-subdomain prefix `<node>-<driver>` of the node's slice names. The
/// node name is lower-cased, other characters become `-`; when that changes it
/// or the prefix is too long, the node part is shortened and a hash of the
/// original node name appended.
#[must_use]
pub fn slice_name_prefix(node: &str, driver: &str) -> String {
    let mapped: String = node
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.') => c,
            _ => '-',
        })
        .collect();
    let clean = |s: &str| -> String {
        s.split('.')
            .map(|l| l.trim_matches('-'))
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(".")
    };
    let driver = clean(&driver.to_ascii_lowercase());
    let sane = clean(&mapped);
    let plain = format!("{sane}-{driver}");
    if sane == node && !sane.is_empty() && plain.len() <= MAX_PREFIX {
        return plain;
    }
    let hash = format!("{:016x}", fnv(node));
    let room = MAX_PREFIX.saturating_sub(driver.len() + hash.len() + 2);
    let short = clean(&sane.chars().take(room).collect::<String>());
    if short.is_empty() {
        format!("{hash}-{driver}")
    } else {
        format!("{short}-{hash}-{driver}")
    }
}

/// The value of [`NODE_LABEL`] for a node: the name itself when it is a valid
/// label value (at most 63), otherwise a shortened form plus a hash of the name.
#[must_use]
pub fn node_label_value(node: &str) -> String {
    if validate::is_label_value(node) {
        return node.to_string();
    }
    let mapped: String = node
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(46)
        .collect();
    let short = mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let hash = format!("{:016x}", fnv(node));
    if short.is_empty() {
        hash
    } else {
        format!("{short}-{hash}")
    }
}

fn numbered(prefix: &str, kind: &str, k: usize, count: usize, min_width: usize) -> String {
    let width = count.saturating_sub(1).to_string().len().max(min_width);
    format!("{prefix}-{kind}-{k:0width$}")
}

// === build ===

fn check_options(o: &SliceOptions) -> Result<(), SliceError> {
    let bad = |field, value: &str, rule: &str| SliceError::InvalidOption {
        field,
        value: value.to_string(),
        rule: rule.to_string(),
    };
    if !validate::is_dns_subdomain(&o.node_name) {
        return Err(bad(
            "node_name",
            &o.node_name,
            "not a node name (DNS subdomain, at most 253 characters)",
        ));
    }
    if o.driver.len() > limits::DRIVER_NAME || !validate::is_dns_subdomain(&o.driver) {
        return Err(bad(
            "driver",
            &o.driver,
            "not a lower-case DNS subdomain of at most 63 characters",
        ));
    }
    if o.pool.is_empty()
        || o.pool.len() > limits::POOL_NAME
        || !o.pool.split('/').all(validate::is_dns_subdomain)
    {
        return Err(bad(
            "pool",
            &o.pool,
            "not DNS subdomains joined by '/' (at most 253 characters)",
        ));
    }
    if o.generation < 0 {
        return Err(bad("generation", &o.generation.to_string(), "negative"));
    }
    for (field, on) in [
        ("sharing.mps", o.sharing.mps),
        ("sharing.mig_mps", o.sharing.mig_mps),
    ] {
        if on && o.sharing.mps_caps.is_none() {
            return Err(bad(
                field,
                "true",
                "MPS devices need sharing.mps_caps (the node's MPS capabilities)",
            ));
        }
    }
    Ok(())
}

/// What one slice will hold, before naming.
#[derive(Default)]
struct Bucket {
    sets: Vec<CounterSet>,
    devices: Vec<Device>,
}

/// Build the node's ResourceSlices in the layout of `opts.layout`.
///
/// 1.35+: counter sets in `-counters-<k>` slices (at most 8 each, `devices`
/// unset), devices in `-devices-<k>` slices (at most 64 each) in
/// [`device_order`]. 1.34: whole GPUs grouped into `-devices-<k>` slices with
/// their counter sets, while the 1.34 limits hold (at most 32 counters in all
/// sets of a slice, so one 8-slice GPU per slice), and a GPU that hosts shares
/// apart ([`ShareLayout::Separate`]) in a slice of its own; devices in
/// [`device_order`] within each slice. `opts.shares` decides which GPUs
/// publish which sharing devices. Every slice has `nodeName`, `driver`, the pool, and
/// `resourceSliceCount` = all slices. No GPUs: no slices.
///
/// # Errors
/// [`SliceError`] naming the option, GPU, profile or rule; no partial result.
pub fn build_slices(
    gpus: &[NodeGpu],
    opts: &SliceOptions,
) -> Result<Vec<ResourceSlice>, SliceError> {
    check_options(opts)?;
    let planned = plan(gpus, opts.order, &opts.sharing, &opts.shares)?;
    // The counters of each distinct spec (see [`model_counters`]);
    // `shared_of[gi]` indexes `shared`.
    let mut shared: Vec<(&GpuSpec, Arc<ModelCounters>)> = Vec::new();
    let mut shared_of: Vec<Option<usize>> = Vec::with_capacity(gpus.len());
    for g in gpus {
        let spec = &g.gpu.spec;
        if !spec.mig_capable {
            let whole_shared = planned.iter().any(|p| {
                matches!(p.kind, Kind::Mps | Kind::TimeSlice) && std::ptr::eq(&gpus[p.gpu], g)
            });
            if !whole_shared {
                shared_of.push(None);
                continue;
            }
        }
        let i = match shared.iter().position(|(s, _)| *s == spec) {
            Some(i) => i,
            None => {
                shared.push((spec, model_counters(spec)));
                shared.len() - 1
            }
        };
        shared_of.push(Some(i));
    }
    let models: Vec<Option<CounterModel<'_>>> = gpus
        .iter()
        .zip(&shared_of)
        .map(|(g, i)| {
            i.map(|i| CounterModel {
                set: counter_set_name(g.gpu.index),
                counters: &shared[i].1,
            })
        })
        .collect();
    let mut mig_left: Vec<Vec<u32>> = gpus
        .iter()
        .map(|g| vec![0; g.gpu.spec.profiles.len()])
        .collect();
    for p in &planned {
        if let Kind::Mig { profile, .. } = p.kind {
            mig_left[p.gpu][profile] += 1;
        }
    }
    let mut parts: Vec<GpuParts> = gpus
        .iter()
        .zip(mig_left)
        .map(|(g, left)| GpuParts::new(&g.gpu, left))
        .collect::<Result<_, _>>()?;
    // Sized once: a collect through `Result` would regrow it (and move every
    // device) about eight times.
    let mut devices: Vec<(usize, Device)> = Vec::with_capacity(planned.len());
    for p in &planned {
        let sharing = if gpus[p.gpu].mps_memory_hard {
            opts.sharing.with_hard_memory()
        } else {
            opts.sharing
        };
        let d = make_device(
            p,
            &gpus[p.gpu].gpu,
            &mut parts[p.gpu],
            models[p.gpu].as_ref(),
            &sharing,
        )?;
        devices.push((p.gpu, d));
    }

    // Per GPU: (counters in its set, its devices, their counter entries).
    let mut per_gpu: Vec<(usize, usize, usize)> = models
        .iter()
        .map(|m| (m.as_ref().map_or(0, CounterModel::counters_len), 0, 0))
        .collect();
    for (gi, d) in &devices {
        let k: usize = d
            .consumes_counters
            .iter()
            .flatten()
            .map(|cc| cc.counters.len())
            .sum();
        per_gpu[*gi].1 += 1;
        per_gpu[*gi].2 += k;
    }
    // Per-GPU limits: a GPU that alone breaks one cannot be published.
    let mut gpu_order: Vec<usize> = (0..gpus.len()).collect();
    gpu_order.sort_by_key(|&i| gpus[i].gpu.index);
    for &gi in &gpu_order {
        let (set, n, c) = per_gpu[gi];
        let limit = |rule, detail: String| SliceError::Limit {
            gpu: gpus[gi].gpu.index,
            product: gpus[gi].gpu.spec.product_name.clone(),
            rule,
            detail,
        };
        if set > limits::COUNTERS_PER_SET {
            return Err(limit(
                Rule::CountersPerSet,
                format!(
                    "{set} counters, at most {} per set",
                    limits::COUNTERS_PER_SET
                ),
            ));
        }
        if opts.layout == KubeLayout::V134 {
            if set > limits::SHARED_COUNTERS_PER_SLICE_V134 {
                return Err(limit(
                    Rule::SharedCountersTotal,
                    format!(
                        "{set} counters, at most {} per 1.34 slice",
                        limits::SHARED_COUNTERS_PER_SLICE_V134
                    ),
                ));
            }
            if n > MAX_DEVICES_PER_SLICE {
                return Err(limit(
                    Rule::DevicesPerSlice,
                    format!(
                        "{n} devices, at most {MAX_DEVICES_PER_SLICE} per slice, and 1.34 keeps a GPU's devices in one slice"
                    ),
                ));
            }
            if c > limits::DEVICE_COUNTERS_PER_SLICE_V134 {
                return Err(limit(
                    Rule::SliceDeviceCounters,
                    format!(
                        "{c} device counter entries, at most {} per 1.34 slice",
                        limits::DEVICE_COUNTERS_PER_SLICE_V134
                    ),
                ));
            }
        }
    }

    let prefix = slice_name_prefix(&opts.node_name, &opts.driver);
    // (name kind, bucket)
    let mut buckets: Vec<(&str, Bucket)> = Vec::new();
    match opts.layout {
        KubeLayout::V135Plus => {
            let mut sets = gpu_order
                .iter()
                .filter_map(|&gi| models[gi].as_ref().map(CounterModel::counter_set))
                .peekable();
            while sets.peek().is_some() {
                buckets.push((
                    "counters",
                    Bucket {
                        sets: sets.by_ref().take(limits::COUNTER_SETS_PER_SLICE).collect(),
                        devices: Vec::new(),
                    },
                ));
            }
            // Move (not clone) the devices into chunks of at most 64.
            let mut rest = devices.into_iter().map(|(_, d)| d).peekable();
            while rest.peek().is_some() {
                buckets.push((
                    "devices",
                    Bucket {
                        sets: Vec::new(),
                        devices: rest.by_ref().take(MAX_DEVICES_PER_SLICE).collect(),
                    },
                ));
            }
        }
        KubeLayout::V134 => {
            // Greedy: whole GPUs in index order while the 1.34 limits hold.
            let mut groups: Vec<Vec<usize>> = Vec::new();
            let mut acc = (0, 0, 0);
            // A GPU that hosts shares apart has a slice of its own: 1.34
            // checks a shared device's capacity against the first device of
            // its slice, and there every device has the same capacity.
            let alone = |gi: usize| match &opts.shares {
                ShareLayout::Separate(listed) => listed.contains_key(&gpus[gi].gpu.index),
                ShareLayout::Mixed => false,
            };
            let mut last_alone = false;
            for &gi in &gpu_order {
                let (s, n, c) = per_gpu[gi];
                let fits = !alone(gi)
                    && !last_alone
                    && acc.0 + s <= limits::SHARED_COUNTERS_PER_SLICE_V134
                    && acc.1 + n <= MAX_DEVICES_PER_SLICE
                    && acc.2 + c <= limits::DEVICE_COUNTERS_PER_SLICE_V134;
                match groups.last_mut() {
                    Some(g) if fits => {
                        g.push(gi);
                        acc = (acc.0 + s, acc.1 + n, acc.2 + c);
                    }
                    _ => {
                        groups.push(vec![gi]);
                        acc = (s, n, c);
                    }
                }
                last_alone = alone(gi);
            }
            // Move (not clone) each device into its GPU's group, keeping order.
            let mut group_of = vec![0; gpus.len()];
            for (k, g) in groups.iter().enumerate() {
                for &gi in g {
                    group_of[gi] = k;
                }
            }
            let mut grouped: Vec<Vec<Device>> = vec![Vec::new(); groups.len()];
            for (gi, d) in devices {
                grouped[group_of[gi]].push(d);
            }
            for (g, devices) in groups.iter().zip(grouped) {
                buckets.push((
                    "devices",
                    Bucket {
                        sets: g
                            .iter()
                            .filter_map(|&gi| models[gi].as_ref().map(CounterModel::counter_set))
                            .collect(),
                        devices,
                    },
                ));
            }
        }
    }

    let total = buckets.len();
    let count_of = |kind: &str| buckets.iter().filter(|(k, _)| *k == kind).count();
    let (n_counters, n_devices) = (count_of("counters"), count_of("devices"));
    let labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (NODE_LABEL.to_string(), node_label_value(&opts.node_name)),
    ]);
    let mut seq: BTreeMap<&str, usize> = BTreeMap::new();
    let mut out = Vec::with_capacity(total);
    for (kind, b) in buckets {
        let k = seq.entry(kind).or_default();
        let name = if kind == "counters" {
            numbered(&prefix, kind, *k, n_counters, 1)
        } else {
            numbered(&prefix, kind, *k, n_devices, 2)
        };
        *k += 1;
        out.push(ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name),
                labels: Some(labels.clone()),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: opts.driver.clone(),
                node_name: Some(opts.node_name.clone()),
                pool: ResourcePool {
                    name: opts.pool.clone(),
                    generation: opts.generation,
                    resource_slice_count: total as i64,
                },
                devices: (!b.devices.is_empty()).then_some(b.devices),
                shared_counters: (!b.sets.is_empty()).then_some(b.sets),
                ..Default::default()
            },
        });
    }
    validate_slices(&out, opts.layout).map_err(SliceError::Invalid)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_become_semver() {
        assert_eq!(semver_of("580.65.06").as_deref(), Some("580.65.6"));
        assert_eq!(semver_of("9.0").as_deref(), Some("9.0.0"));
        assert_eq!(semver_of("550").as_deref(), Some("550.0.0"));
        assert_eq!(semver_of("1.2.3.04").as_deref(), Some("1.2.3+04"));
        assert_eq!(semver_of("580.x"), None);
        assert_eq!(semver_of(""), None);
    }

    #[test]
    fn layout_follows_the_server_version() {
        assert_eq!(KubeLayout::for_version(1, 34).unwrap(), KubeLayout::V134);
        assert_eq!(
            KubeLayout::for_version(1, 35).unwrap(),
            KubeLayout::V135Plus
        );
        assert_eq!(
            KubeLayout::for_version(1, 37).unwrap(),
            KubeLayout::V135Plus
        );
        assert_eq!(
            KubeLayout::from_version_info("1", "36+").unwrap(),
            KubeLayout::V135Plus
        );
        assert!(matches!(
            KubeLayout::for_version(1, 33),
            Err(SliceError::UnsupportedVersion { version }) if version == "1.33"
        ));
        assert!(KubeLayout::from_version_info("1", "x").is_err());
    }

    #[test]
    fn slice_names_are_subdomains_for_any_node_name() {
        assert_eq!(
            slice_name_prefix("node-1", "gpu.carve.dev"),
            "node-1-gpu.carve.dev"
        );
        for node in ["Node_1", &"n".repeat(253), "-.-", "a..b", "ÄÖ"] {
            let p = slice_name_prefix(node, "gpu.carve.dev");
            assert!(validate::is_dns_subdomain(&p), "{node:?} -> {p:?}");
            assert!(p.len() <= MAX_PREFIX, "{node:?}");
            assert_ne!(p, slice_name_prefix("other", "gpu.carve.dev"));
        }
        assert_ne!(
            slice_name_prefix("Node_1", "gpu.carve.dev"),
            slice_name_prefix("node-1", "gpu.carve.dev")
        );
    }

    #[test]
    fn node_label_values_stay_valid() {
        assert_eq!(node_label_value("node-1"), "node-1");
        for node in [&"n".repeat(100) as &str, "a.b.c/d", "-x-", "ÄÖ"] {
            let v = node_label_value(node);
            assert!(validate::is_label_value(&v), "{node:?} -> {v:?}");
            assert!(!v.is_empty());
        }
        assert_ne!(
            node_label_value(&"n".repeat(100)),
            node_label_value(&"n".repeat(101))
        );
    }
}
