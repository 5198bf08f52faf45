//! The hardware seam: one [`GpuBackend`] trait and its value types. No
//! implementation lives here; `carve-nvml` implements it over NVML (which, in CI,
//! loads the NVML simulator library `carve-nvml-sim`).
//!
//! Calls are blocking (NVML is a blocking C library); async callers wrap them in
//! `spawn_blocking`. Implementations are passed in explicitly, never chosen by
//! `cfg!(test)`.
//!
//! Health events are a separate trait, [`GpuEvents`]; their value types
//! ([`GpuEvent`], [`EventKind`]) live in the pure `carve_model::health` and are
//! re-exported here.

use std::time::Duration;

use carve_model::health::LiveInstance;
use carve_model::{Architecture, MigProfile, Placement};
use serde::{Deserialize, Serialize};

pub use carve_model::health::{EventKind, GpuEvent};

/// Current and pending MIG mode of a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMode {
    /// MIG mode in effect now.
    pub current: bool,
    /// MIG mode after the next GPU reset (equals `current` when nothing is pending).
    pub pending: bool,
}

/// One physical GPU as the backend sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// UUID, `GPU-...`.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Architecture.
    pub architecture: Architecture,
    /// CUDA compute capability (major, minor).
    pub cuda_compute_capability: (u32, u32),
    /// Driver version string as NVML reports it (e.g. `580.65.06`).
    pub driver_version: String,
    /// PCI bus id (`0000:3b:00.0`).
    pub pci_bus_id: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Whether the GPU supports MIG at all.
    pub mig_capable: bool,
    /// MIG mode, when MIG-capable.
    pub mig_mode: Option<MigMode>,
}

impl GpuInfo {
    /// The GPU's spec with these MIG profiles (as NVML reported them): memory
    /// slices = furthest placement end, compute slices = largest profile,
    /// engines = component-wise maximum over profiles.
    #[must_use]
    pub fn spec(&self, profiles: Vec<MigProfile>) -> carve_model::GpuSpec {
        carve_model::GpuSpec {
            product_name: self.name.clone(),
            architecture: self.architecture,
            cuda_compute_capability: self.cuda_compute_capability,
            memory_mib: self.memory_mib,
            multiprocessors: self.multiprocessors,
            memory_slices: profiles
                .iter()
                .flat_map(|p| p.placements.iter().map(|pl| pl.end()))
                .max()
                .unwrap_or(0),
            compute_slices: profiles.iter().map(|p| p.compute_slices).max().unwrap_or(0),
            engines: profiles
                .iter()
                .fold(carve_model::Engines::default(), |e, p| e.max(p.engines)),
            mig_capable: self.mig_capable,
            profiles,
        }
    }

    /// The GPU as the slice builder and the sharing model see it, with
    /// `spec` (normally [`GpuInfo::spec`]). A driver version that is not a
    /// version becomes `0.0.0`.
    #[must_use]
    pub fn physical(&self, spec: carve_model::GpuSpec) -> carve_model::PhysicalGpu {
        carve_model::PhysicalGpu {
            index: self.index,
            minor: self.minor,
            uuid: self.uuid.clone(),
            pci_bus_id: Some(self.pci_bus_id.clone()),
            pcie_root: None,
            driver_version: carve_model::slices::semver_of(&self.driver_version)
                .unwrap_or_else(|| "0.0.0".into()),
            spec,
        }
    }
}

/// A compute instance inside a GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeInstanceInfo {
    /// Compute-instance id (unique within its GPU instance).
    pub id: u32,
    /// NVML compute-instance profile id.
    pub profile_id: u32,
    /// UUID of the MIG device this CI forms (`MIG-...`), when NVML reports one.
    pub mig_uuid: Option<String>,
}

/// A GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInstanceInfo {
    /// GPU index of the parent.
    pub gpu: u32,
    /// GPU-instance id (unique within its GPU).
    pub id: u32,
    /// NVML GPU-instance profile id.
    pub profile_id: u32,
    /// Where it sits.
    pub placement: Placement,
    /// Its compute instances.
    pub compute_instances: Vec<ComputeInstanceInfo>,
}

/// Compute mode of a GPU or MIG device (`nvmlComputeMode_t`). MPS wants
/// [`ComputeMode::ExclusiveProcess`]. On Linux it resets to `Default` with the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ComputeMode {
    /// Several contexts per device.
    Default,
    /// No contexts.
    Prohibited,
    /// One context (process) per device, e.g. the MPS server.
    ExclusiveProcess,
}

/// What a compute-mode call addresses: with MIG enabled NVML accepts only MIG
/// devices (one per compute instance), otherwise only the whole GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ComputeTarget {
    /// A whole GPU by index.
    Gpu(u32),
    /// The MIG device of compute instance `ci` in GPU instance `gi` of `gpu`.
    Mig {
        /// GPU index.
        gpu: u32,
        /// GPU-instance id.
        gi: u32,
        /// Compute-instance id.
        ci: u32,
    },
}

/// What a caller should do with an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Try again later (the resource is busy).
    Retry,
    /// The thing to remove is already gone: count as done.
    AlreadyDone,
    /// Give up and report.
    Fatal,
}

/// A backend failure, mapped from NVML return codes so callers can decide.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The NVML library could not be loaded or initialised.
    #[error("NVML unavailable: {reason}")]
    Unavailable {
        /// Why.
        reason: String,
    },
    /// The loaded NVML library lacks a symbol carve needs.
    #[error("NVML library lacks symbol {symbol}")]
    MissingSymbol {
        /// The symbol.
        symbol: String,
    },
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`: e.g. the placement is occupied.
    #[error("{call}: insufficient resources ({what})")]
    InsufficientResources {
        /// NVML function.
        call: &'static str,
        /// What was asked.
        what: String,
    },
    /// `NVML_ERROR_IN_USE`: e.g. destroying an instance a client still holds.
    #[error("{call}: in use ({what})")]
    InUse {
        /// NVML function.
        call: &'static str,
        /// What was asked.
        what: String,
    },
    /// `NVML_ERROR_NOT_FOUND`: the instance is already gone.
    #[error("{call}: not found ({what})")]
    NotFound {
        /// NVML function.
        call: &'static str,
        /// What was asked.
        what: String,
    },
    /// `NVML_ERROR_NO_PERMISSION`.
    #[error("{call}: no permission ({what})")]
    NoPermission {
        /// NVML function.
        call: &'static str,
        /// What was asked.
        what: String,
    },
    /// `NVML_ERROR_NOT_SUPPORTED`.
    #[error("{call}: not supported ({what})")]
    NotSupported {
        /// NVML function.
        call: &'static str,
        /// What was asked.
        what: String,
    },
    /// The GPU reports profile data that breaks carve's invariants.
    #[error("GPU {gpu}: inconsistent MIG profile data: {reason}")]
    Inconsistent {
        /// GPU index.
        gpu: u32,
        /// What is inconsistent.
        reason: String,
    },
    /// No GPU, GPU instance or compute instance with that id.
    #[error("no such {what}")]
    NoSuch {
        /// What was looked up.
        what: String,
    },
    /// Any other NVML return code.
    #[error("{call} failed with NVML code {code}: {what}")]
    Nvml {
        /// NVML function.
        call: &'static str,
        /// Return code.
        code: u32,
        /// What was asked.
        what: String,
    },
    /// Reading the MIG capability files failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    /// What a caller should do with this error.
    #[must_use]
    pub fn disposition(&self) -> Disposition {
        match self {
            Self::InUse { .. } => Disposition::Retry,
            Self::NotFound { .. } => Disposition::AlreadyDone,
            _ => Disposition::Fatal,
        }
    }

    /// Whether NVML reported `NVML_ERROR_GPU_IS_LOST` (code 15: the GPU fell
    /// off the bus or is otherwise inaccessible), for
    /// `carve_model::health::HealthState::observe_gpu`.
    #[must_use]
    pub fn is_gpu_lost(&self) -> bool {
        matches!(self, Self::Nvml { code: 15, .. })
    }
}

/// The operations carve needs from the GPUs of a node.
pub trait GpuBackend: Send + Sync + std::fmt::Debug {
    /// Every GPU on the node, in NVML index order.
    ///
    /// # Errors
    /// NVML failures.
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError>;

    /// The GPU-instance profiles of a GPU with their placements, read from NVML
    /// (profile indexes enumerated, unsupported ones skipped, ids and placements
    /// as NVML returns them). Empty for a GPU that is not MIG-capable.
    ///
    /// # Errors
    /// NVML failures, or [`BackendError::Inconsistent`] profile data.
    fn profiles(&self, gpu: u32) -> Result<Vec<MigProfile>, BackendError>;

    /// MIG mode of a GPU.
    ///
    /// # Errors
    /// NVML failures.
    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError>;

    /// Enable or disable MIG mode; returns the mode afterwards (on Ampere the
    /// change stays pending until a GPU reset).
    ///
    /// # Errors
    /// NVML failures.
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigMode, BackendError>;

    /// Every GPU instance of a GPU with its compute instances.
    ///
    /// # Errors
    /// NVML failures.
    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceInfo>, BackendError>;

    /// Create a GPU instance of `profile_id` at exactly `placement`.
    ///
    /// # Errors
    /// [`BackendError::InsufficientResources`] when the placement is occupied.
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: Placement,
    ) -> Result<GpuInstanceInfo, BackendError>;

    /// Create the compute instance that spans the whole GPU instance `gi`.
    ///
    /// # Errors
    /// NVML failures.
    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<ComputeInstanceInfo, BackendError>;

    /// Destroy a compute instance.
    ///
    /// # Errors
    /// [`BackendError::NotFound`] when already gone, [`BackendError::InUse`].
    fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError>;

    /// Destroy a GPU instance (its compute instances must be gone).
    ///
    /// # Errors
    /// [`BackendError::NotFound`] when already gone, [`BackendError::InUse`].
    fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError>;

    /// The device-file minor of a MIG capability: GI when `ci` is `None`, else CI.
    /// Read from `<root>/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access`
    /// (`root` is `/proc/driver/nvidia` on a real node, configurable for tests).
    ///
    /// # Errors
    /// The file is missing or unreadable.
    fn capability_minor(
        &self,
        gpu_minor: u32,
        gi: u32,
        ci: Option<u32>,
    ) -> Result<u32, BackendError>;

    /// Compute mode of a whole GPU or a MIG device.
    ///
    /// # Errors
    /// [`BackendError::NotSupported`] for a whole GPU in MIG mode,
    /// [`BackendError::NotFound`] for a missing GPU or compute instance.
    fn compute_mode(&self, target: ComputeTarget) -> Result<ComputeMode, BackendError>;

    /// Set the compute mode of a whole GPU or a MIG device (takes effect now;
    /// not kept across a GPU reset).
    ///
    /// # Errors
    /// As [`GpuBackend::compute_mode`]; [`BackendError::NoPermission`] when not root.
    fn set_compute_mode(
        &self,
        target: ComputeTarget,
        mode: ComputeMode,
    ) -> Result<(), BackendError>;
}

/// Health events of the node's GPUs (XID, single- and double-bit ECC), kept
/// apart from [`GpuBackend`] so that watching never blocks MIG operations.
pub trait GpuEvents: Send + Sync + std::fmt::Debug {
    /// Wait up to `timeout` for events and return those that arrived (empty on
    /// timeout), in arrival order. The first call starts watching every GPU; a
    /// GPU that cannot be watched is reported once, by an
    /// [`EventKind::Unmonitored`] event returned at once, and never again.
    /// Events that happen before watching starts are not delivered.
    ///
    /// # Errors
    /// NVML failures while starting to watch (nothing stays registered; a later
    /// call tries again) or while waiting.
    fn wait_events(&self, timeout: Duration) -> Result<Vec<GpuEvent>, BackendError>;
}

/// The live instances of one GPU with the MIG device each occupies, for
/// `carve_model::health::HealthState::apply`. `profiles` are the GPU's
/// profiles ([`GpuBackend::profiles`]).
///
/// # Errors
/// [`BackendError::Inconsistent`] naming the GPU, instance and profile id when
/// an instance has a profile id not in `profiles` or one without a device name.
pub fn live_instances(
    instances: &[GpuInstanceInfo],
    profiles: &[MigProfile],
) -> Result<Vec<LiveInstance>, BackendError> {
    instances
        .iter()
        .map(|gi| {
            let bad = |why: String| BackendError::Inconsistent {
                gpu: gi.gpu,
                reason: format!("GPU instance {}: {why}", gi.id),
            };
            let p = profiles
                .iter()
                .find(|p| p.id == gi.profile_id)
                .ok_or_else(|| bad(format!("unknown profile id {}", gi.profile_id)))?;
            LiveInstance::new(gi.gpu, gi.id, &p.name, gi.placement.start)
                .map_err(|e| bad(e.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::{DeviceName, GpuModel};

    #[test]
    fn only_nvml_code_15_is_gpu_lost() {
        let e = |code| BackendError::Nvml {
            call: "nvmlDeviceGetMigMode",
            code,
            what: "GPU 0".into(),
        };
        assert!(e(15).is_gpu_lost());
        assert!(!e(999).is_gpu_lost());
        assert!(
            !BackendError::NoSuch {
                what: "GPU 0".into()
            }
            .is_gpu_lost()
        );
    }

    #[test]
    fn live_instances_name_their_mig_device_or_the_bad_profile_id() {
        let spec = GpuModel::find("h100-80gb").unwrap().spec();
        let p = spec.profile("1g.10gb").unwrap();
        let gi = |id, profile_id, start| GpuInstanceInfo {
            gpu: 3,
            id,
            profile_id,
            placement: Placement::new(start, 1),
            compute_instances: Vec::new(),
        };
        let live = live_instances(&[gi(2, p.id, 5)], &spec.profiles).unwrap();
        assert_eq!(live[0].gi, 2);
        assert_eq!(
            live[0].device,
            "gpu-3-mig-1g10gb-5".parse::<DeviceName>().unwrap()
        );
        let e = live_instances(&[gi(2, p.id, 5), gi(4, 999, 0)], &spec.profiles).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("GPU 3") && msg.contains("GPU instance 4") && msg.contains("999"),
            "{msg}"
        );
    }
}
