//! Why a claim failed: [`ClaimError`], the one error a prepare or unprepare
//! of one claim returns (the kubelet gets its message in that claim's
//! `error` field), and the few conversions from the errors of the layers
//! below (NVML, blocking tasks, the host lock) that the lifecycle files use.

use std::path::PathBuf;
use std::sync::Arc;

use carve_gpu::BackendError;
use carve_model::{NameError, Placement};

use crate::cdi::CdiError;
use crate::checkpoint::CheckpointError;
use crate::claim::InvalidClaim;
use crate::config::ConfigError;
use crate::driver_root::DriverRootError;

/// Why one claim could not be prepared or unprepared. Reported in that claim's
/// `error` field; other claims of the same call are unaffected.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Kubelet sent a claim with an empty field.
    #[error(transparent)]
    Invalid(#[from] InvalidClaim),
    /// The ResourceClaim does not exist. (The message does not repeat the
    /// claim's name: the per-claim error the kubelet gets names it once.)
    #[error("ResourceClaim not found")]
    NotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The ResourceClaim has another UID than kubelet asked for.
    #[error("claim got replaced: ResourceClaim has UID {found}, kubelet asked for {expected}")]
    Replaced {
        /// UID kubelet sent.
        expected: String,
        /// UID on the server.
        found: String,
    },
    /// The ResourceClaim has no allocation.
    #[error("ResourceClaim is not allocated")]
    NotAllocated,
    /// A device of this driver is allocated from another node's pool.
    #[error("device {device} is allocated from pool {pool:?}, not this node's pool {ours:?}")]
    OtherPool {
        /// Device.
        device: String,
        /// Its pool.
        pool: String,
        /// This node's pool.
        ours: String,
    },
    /// A device name is not one of carve's.
    #[error(transparent)]
    BadDeviceName(#[from] NameError),
    /// An MPS device on a node where the plugin runs without MPS.
    #[error(
        "device {device}: MPS is not enabled on this node (the plugin runs without --sharing mps/mig-mps and --mps-control)"
    )]
    MpsDisabled {
        /// Device.
        device: String,
    },
    /// A shareable device's allocation lacks what a share needs.
    #[error("device {device}: {reason}")]
    BadShare {
        /// Device.
        device: String,
        /// What is missing or wrong.
        reason: String,
    },
    /// The allocation's `consumedCapacity` cannot become MPS limits.
    #[error("device {device}: {source}")]
    Sharing {
        /// Device.
        device: String,
        /// Why.
        #[source]
        source: Box<carve_model::sharing::SharingError>,
    },
    /// Hard MPS limits bind the share to a pod cgroup, and none was found.
    #[error(
        "device {device}: hard MPS limits bind the share to its pod's cgroup, and no cgroup under {root} belongs to the claim's reserved pods {pods:?}"
    )]
    NoPodCgroup {
        /// Device.
        device: String,
        /// Pod UIDs from `status.reservedFor`.
        pods: Vec<String>,
        /// The cgroup root searched.
        root: PathBuf,
    },
    /// Setting, reading back or clearing a hard memory limit failed (the
    /// error names the GPU, the cgroup and the tool's output).
    #[error("device {device}: {source}")]
    MemoryLimit {
        /// Device (or, when clearing, the claim).
        device: String,
        /// What failed.
        #[source]
        source: Box<carve_mps::memlimit::MemLimitError>,
    },
    /// The MPS control daemon refused or failed (the error names the unit,
    /// which is the device).
    #[error("{source}")]
    Mps {
        /// Device.
        device: String,
        /// Why.
        #[source]
        source: Box<carve_mps::MpsError>,
    },
    /// The device names a GPU index this node does not have.
    #[error("device {device}: this node has no GPU {gpu}")]
    NoSuchGpu {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
    },
    /// A MIG device on a GPU without MIG support.
    #[error("device {device}: GPU {gpu} ({uuid}) is not MIG-capable")]
    NotMigCapable {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// GPU UUID.
        uuid: String,
    },
    /// The GPU has no such MIG profile.
    #[error("device {device}: GPU {gpu} has no MIG profile {profile}")]
    NoSuchProfile {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// Profile name.
        profile: String,
    },
    /// The profile cannot start at that memory slice.
    #[error(
        "device {device}: profile {profile} cannot be placed at slice {start} (allowed starts: {allowed:?})"
    )]
    BadPlacement {
        /// Device.
        device: String,
        /// Profile name.
        profile: String,
        /// Requested start.
        start: u8,
        /// Allowed starts.
        allowed: Vec<u8>,
    },
    /// The placement overlaps an existing instance.
    #[error("device {device}: placement {placement} on GPU {gpu} is occupied by {by}")]
    Occupied {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// The wanted placement.
        placement: Placement,
        /// What occupies it.
        by: String,
    },
    /// The GPU is in use by another claim in a way that excludes this device.
    #[error("device {device}: GPU {gpu} is held {by}")]
    GpuHeld {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// The holder and how it holds the GPU.
        by: String,
    },
    /// A whole GPU was asked for but MIG instances exist on it.
    #[error("device {device}: GPU {gpu} still has MIG instances: {instances}")]
    GpuHasInstances {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// The instances.
        instances: String,
    },
    /// Static GPU without an instance at the allocated placement.
    #[error("device {device}: static GPU {gpu} has no {profile} instance at placement {placement}")]
    StaticMissing {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// Profile.
        profile: String,
        /// Placement.
        placement: Placement,
    },
    /// A whole GPU was allocated on a GPU that is in MIG mode and cannot leave it.
    #[error("device {device}: GPU {gpu} is in MIG mode and carve cannot turn it off: {why}")]
    WholeInMigMode {
        /// Device.
        device: String,
        /// GPU index.
        gpu: u32,
        /// Why not.
        why: &'static str,
    },
    /// Enabling MIG mode needs a GPU reset first.
    #[error(
        "GPU {gpu}: MIG mode is off and enabling it needs a GPU reset on this architecture; enable MIG mode ahead of time"
    )]
    MigPending {
        /// GPU index.
        gpu: u32,
    },
    /// Invalid opaque configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An NVML operation failed.
    #[error("{op}: {source}")]
    Backend {
        /// What was being done.
        op: String,
        /// The error.
        #[source]
        source: BackendError,
    },
    /// An instance stayed in use through every retry.
    #[error("{op}: still in use after {attempts} attempts: {source}")]
    Busy {
        /// What was being done.
        op: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        #[source]
        source: BackendError,
    },
    /// The API server call failed or did not answer in time
    /// ([`PluginConfig::api_timeout`]).
    #[error("API server: {what}: {source}")]
    Kube {
        /// What was being done (without the claim's name, which the
        /// per-claim error carries once).
        what: String,
        /// The error.
        #[source]
        source: Box<crate::api::ApiFailure>,
    },
    /// The checkpoint could not be written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The CDI spec could not be written or removed.
    #[error(transparent)]
    Cdi(#[from] CdiError),
    /// The NVIDIA driver's files or device numbers a container needs were not
    /// found (nothing was changed for the claim).
    #[error("containers cannot get the NVIDIA driver: {0}")]
    Driver(#[from] Arc<DriverRootError>),
    /// A blocking task failed.
    #[error("blocking task: {0}")]
    Task(String),
}

/// `map_err` for an NVML call: the error names what was being done.
pub(super) fn backend_err(op: impl Into<String>) -> impl FnOnce(BackendError) -> ClaimError {
    let op = op.into();
    move |source| ClaimError::Backend { op, source }
}

impl ClaimError {
    /// The cross-process checkpoint lock (`<checkpoint>.lock`) could not be
    /// taken.
    pub(super) fn host_lock(path: PathBuf, source: std::io::Error) -> Self {
        Self::Checkpoint(CheckpointError::Io { path, source })
    }
}
