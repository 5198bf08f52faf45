//! The driver: prepare and unprepare claims against the GPUs, keep the
//! checkpoint and CDI specs, and converge from NVML truth at start.
//!
//! Locking: one async mutex per GPU serialises NVML work on that GPU (taken in
//! ascending GPU order); the checkpoint mutex is taken inside GPU locks and is
//! never held across NVML calls; one mutex per claim UID makes repeated calls
//! for the same claim idempotent. NVML calls run in `spawn_blocking`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use carve_gpu::{BackendError, Disposition, GpuBackend, GpuInfo, GpuInstanceInfo};
use carve_model::sharing::{MpsDeviceSpec, translate};
use carve_model::{DeviceName, MigProfile, NameError, Placement};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams, Patch, PatchParams};

use crate::cdi::{self, CdiDevice, CdiError, CdiSpec};
use crate::checkpoint::{
    self, Checkpoint, CheckpointBody, CheckpointError, ClaimRecord, ClaimState, DeviceRecord,
    MpsShare, PreparedKind, move_aside,
};
use crate::claim::{ClaimRef, InvalidClaim, PreparedDevice, ReadClaim};
use crate::config::{
    ConfigError, GpuPolicy, MpsSetup, PluginConfig, Retry, capabilities_env,
    effective_capabilities, effective_mps, parse_configs,
};
use crate::driver_root::{DriverRootError, NodeDriver};
use crate::error::PluginError;

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

/// What recovery found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Completed claims kept.
    pub kept: Vec<String>,
    /// Half-prepared or half-unprepared claims rolled back.
    pub rolled_back: Vec<String>,
    /// Claims adopted from the API server after a corrupt checkpoint.
    pub adopted: Vec<String>,
    /// Instances destroyed by the orphan sweep, as `gpu/gi`.
    pub swept: Vec<String>,
    /// CDI specs rewritten because they were missing or different.
    pub cdi_rewritten: Vec<String>,
    /// Completed claims whose MIG instance is gone (kept; unprepare will succeed).
    pub missing_instances: Vec<String>,
    /// The checkpoint was from another boot and was discarded.
    pub discarded_other_boot: bool,
    /// Where an unusable checkpoint was moved.
    pub moved_aside: Option<PathBuf>,
    /// MPS units of kept claims and what their daemons needed (adopted
    /// untouched, restarted with the limits re-applied, ...).
    pub mps_units: Vec<(String, carve_mps::Ensure)>,
    /// MPS daemons stopped because no kept claim uses them.
    pub mps_stopped: Vec<String>,
    /// MPS units of kept claims that could not be restored, with why; the
    /// plugin starts anyway and supervision keeps trying.
    pub mps_failed: Vec<(String, String)>,
    /// Devices whose compute mode was set back to `DEFAULT`.
    pub compute_mode_restored: Vec<String>,
}

#[derive(Debug)]
struct GpuRuntime {
    mig_current: bool,
}

#[derive(Debug)]
struct Gpu {
    info: GpuInfo,
    profiles: Vec<MigProfile>,
    policy: GpuPolicy,
    /// The GPU as the slice builder sees it (for MPS share ranges).
    physical: carve_model::PhysicalGpu,
    rt: tokio::sync::Mutex<GpuRuntime>,
}

/// The cross-process checkpoint lock ([`Driver::host_lock`]): released on drop.
struct HostLock {
    _file: std::fs::File,
    _local: tokio::sync::OwnedMutexGuard<()>,
}

/// What this process last wrote to or read from the checkpoint file.
#[derive(Debug)]
struct DiskCopy {
    /// The file's bytes and their body (kept only with a pod UID, for
    /// [`Driver::host_lock`]: a file with these bytes needs no parsing).
    file: Option<(Arc<[u8]>, CheckpointBody)>,
    /// The file may record a GPU in `mig_enabled_by_plugin`, so replacing it
    /// must be durable ([`Driver::persist`], `checkpoint` module docs).
    records_mig: bool,
    /// The same for the spare file the next write overwrites in place (what
    /// the last write replaced; `fsutil::exchange_write`): after a power
    /// loss a write that was not fsynced may show the spare's old content.
    spare_records_mig: bool,
}

impl DiskCopy {
    /// Before this process has read or written anything: both files may
    /// record anything.
    fn unknown() -> Self {
        Self {
            file: None,
            records_mig: true,
            spare_records_mig: true,
        }
    }
}

/// GI/CI and stranded-slice gauges to set from NVML
/// ([`Driver::instance_gauges`]).
struct InstanceGauges {
    metrics: Arc<carve_metrics::Metrics>,
    /// GPU index, UUID (the gauges' label) and spec.
    targets: Vec<(u32, String, carve_model::GpuSpec)>,
}

impl InstanceGauges {
    /// Read the GPUs' instances and set the gauges. Blocking.
    fn run(&self, b: &dyn GpuBackend) {
        let m = &self.metrics;
        for (g, uuid, spec) in &self.targets {
            match b.gpu_instances(*g) {
                Ok(v) => {
                    let cis: usize = v.iter().map(|gi| gi.compute_instances.len()).sum();
                    m.set_instances(uuid, v.len() as u64, cis as u64);
                    let live: Vec<carve_model::Instance> = v
                        .iter()
                        .filter_map(|gi| {
                            let profile =
                                spec.profiles.iter().position(|p| p.id == gi.profile_id)?;
                            Some(carve_model::Instance {
                                profile,
                                start: gi.placement.start,
                            })
                        })
                        .collect();
                    if let Ok(occ) = carve_model::Occupancy::with(spec, &live) {
                        let st = occ.stranded();
                        m.set_stranded(
                            uuid,
                            u64::from(st.memory_slices),
                            u64::from(st.compute_slices),
                        );
                    }
                }
                Err(e) => tracing::debug!(gpu = g, error = %e, "instance count for metrics"),
            }
        }
    }
}

/// Who put the checkpoint file's content there ([`Driver::remember`]).
#[derive(Clone, Copy)]
enum Source {
    Written,
    Read,
}

/// The checkpoint as [`Driver::host_lock`] found it.
enum Reread {
    /// The bytes this process last wrote or read: nothing to parse.
    Unchanged(CheckpointBody),
    /// Written by another process (or first read).
    Changed(Arc<[u8]>, Box<Checkpoint>),
    /// No file.
    Missing,
}

/// The claim-preparing core, independent of gRPC.
pub struct Driver {
    config: Arc<PluginConfig>,
    backend: Arc<dyn GpuBackend>,
    client: kube::Client,
    gpus: BTreeMap<u32, Arc<Gpu>>,
    state: tokio::sync::Mutex<CheckpointBody>,
    claim_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Queue of this process's operations for the host lock.
    host_mutex: Arc<tokio::sync::Mutex<()>>,
    boot_id: String,
    disk: std::sync::Mutex<DiskCopy>,
    /// Status writes (`status.devices`) still in flight, by claim UID: a
    /// prepare returns without waiting for its write; the claim's unprepare
    /// waits for it (see [`STATUS_SETTLE`]).
    status_writes: std::sync::Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    /// Claim GETs and status PATCHes in flight at once ([`API_CONCURRENCY`]).
    api_calls: Arc<tokio::sync::Semaphore>,
    /// The NVIDIA driver's files, as the last discovery found them
    /// ([`Driver::node_driver`]).
    node_driver: std::sync::RwLock<Arc<NodeDriver>>,
}

/// Claim reads and status writes in flight at once. The kube client opens one
/// connection per concurrent request and keeps every one idle in its pool
/// (with its buffers) for 90 s: a burst of 56 prepares left 56 connections
/// behind. Four keep a burst's GETs flowing (the host lock serialises the
/// prepares themselves) and bound what is kept to about four (a connection
/// may still be on its way back to the pool when the next request starts),
/// as client-go's QPS/burst limits bound a Go plugin's requests.
pub const API_CONCURRENCY: usize = 4;

/// How long an unprepare (or a stopping plugin) waits for a status write of
/// the same claim that is still in flight before it aborts it: the write is
/// informational, the kubelet's call is not.
pub const STATUS_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("node", &self.config.node_name)
            .field("gpus", &self.gpus.len())
            .field("boot_id", &self.boot_id)
            .finish_non_exhaustive()
    }
}

/// Log what a driver discovery could not find: once per distinct problem
/// (`before`: the previous discovery, whose problems were logged already);
/// the caps major only where some GPU is MIG-capable.
fn log_driver(nd: &NodeDriver, needs_caps: bool, before: Option<&NodeDriver>) {
    let old = before.map(NodeDriver::problems).unwrap_or_default();
    if let Err(e) = &nd.files {
        if !old.contains(&e.to_string()) {
            tracing::error!(error = %e, "containers cannot get the NVIDIA driver: every prepare fails until it is found");
        }
    } else if let (Ok(f), Some(b)) = (&nd.files, before)
        && b.files.as_ref().map_or(true, |o| o.version != f.version)
    {
        tracing::info!(version = %f.version, libraries = %f.lib_dir, "NVIDIA driver found");
    }
    if needs_caps
        && let Err(e) = &nd.caps_major
        && !old.contains(&e.to_string())
    {
        tracing::error!(error = %e, "MIG devices cannot be given to containers: every MIG prepare fails until it is found");
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| e.to_string())
}

/// Run file writes `f`: on a blocking thread when they fsync (milliseconds on
/// a busy disk), else right here. Without fsync a checkpoint write is an
/// in-place write and a name exchange (`fsutil::exchange_write`), and a CDI
/// spec a new file on a tmpfs: tens of microseconds, less than the two
/// thread hand-offs of a blocking hop.
async fn on_disk<T: Send + 'static>(
    durable: bool,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    if durable { blocking(f).await } else { Ok(f()) }
}

fn backend_err(op: impl Into<String>) -> impl FnOnce(BackendError) -> ClaimError {
    let op = op.into();
    move |source| ClaimError::Backend { op, source }
}

/// Call `f` until it succeeds, reports already-done, or fails fatally;
/// `IN_USE` is retried with backoff. Blocking.
fn with_retry(
    retry: Retry,
    op: &str,
    mut f: impl FnMut() -> Result<(), BackendError>,
) -> Result<(), ClaimError> {
    let mut delay = retry.initial;
    let attempts = retry.attempts.max(1);
    for n in 1..=attempts {
        match f() {
            Ok(()) => return Ok(()),
            Err(e) => match e.disposition() {
                Disposition::AlreadyDone => return Ok(()),
                Disposition::Retry if n < attempts => {
                    tracing::warn!(op, attempt = n, error = %e, "in use; retrying");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(retry.max);
                }
                Disposition::Retry => {
                    return Err(ClaimError::Busy {
                        op: op.to_string(),
                        attempts,
                        source: e,
                    });
                }
                Disposition::Fatal => {
                    return Err(ClaimError::Backend {
                        op: op.to_string(),
                        source: e,
                    });
                }
            },
        }
    }
    Ok(())
}

/// Destroy a GPU instance and its compute instances. Blocking.
fn destroy_instance(
    backend: &dyn GpuBackend,
    retry: Retry,
    gpu: u32,
    gi: &GpuInstanceInfo,
) -> Result<(), ClaimError> {
    for ci in &gi.compute_instances {
        with_retry(
            retry,
            &format!(
                "destroy compute instance {} of GPU {gpu} GI {}",
                ci.id, gi.id
            ),
            || backend.destroy_compute_instance(gpu, gi.id, ci.id),
        )?;
    }
    with_retry(retry, &format!("destroy GPU {gpu} GI {}", gi.id), || {
        backend.destroy_gpu_instance(gpu, gi.id)
    })
}

fn describe(gi: &GpuInstanceInfo, profiles: &[MigProfile]) -> String {
    let p = profiles.iter().find(|p| p.id == gi.profile_id).map_or_else(
        || format!("profile id {}", gi.profile_id),
        |p| p.name.clone(),
    );
    format!("GPU instance {} ({p} at {})", gi.id, gi.placement)
}

/// A device of a claim after validation, before any hardware change.
#[derive(Debug, Clone)]
struct Planned {
    record: DeviceRecord,
}

impl Driver {
    /// Read the GPU inventory (once; the hot path never re-enumerates).
    ///
    /// # Errors
    /// NVML failures.
    pub async fn new(
        config: PluginConfig,
        backend: Arc<dyn GpuBackend>,
        client: kube::Client,
    ) -> Result<Self, PluginError> {
        let backend = match &config.metrics {
            Some(m) => crate::metrics::TimedBackend::wrap(backend, m.clone()),
            None => backend,
        };
        let b = backend.clone();
        let policies: BTreeMap<u32, GpuPolicy> = config.gpu_policy.clone();
        let default = config.default_policy;
        let inv = blocking(
            move || -> Result<Vec<(GpuInfo, Vec<MigProfile>)>, PluginError> {
                let mut out = Vec::new();
                for g in b.gpus().map_err(|source| PluginError::Backend {
                    op: "list GPUs".into(),
                    source,
                })? {
                    // A GPU whose MIG data cannot be read (an NVML without the
                    // MIG calls, inconsistent profiles) is served whole: one
                    // error for it, no MIG devices, the other GPUs unaffected.
                    let profiles = if g.mig_capable {
                        b.profiles(g.index).unwrap_or_else(|error| {
                            tracing::error!(gpu.index = g.index, gpu.uuid = %g.uuid, %error, "no MIG devices for this GPU");
                            Vec::new()
                        })
                    } else {
                        Vec::new()
                    };
                    out.push((g, profiles));
                }
                Ok(out)
            },
        )
        .await
        .map_err(|reason| PluginError::Task {
            what: "GPU inventory",
            reason,
        })??;
        let gpus = inv
            .into_iter()
            .map(|(info, profiles)| {
                let policy = policies.get(&info.index).copied().unwrap_or(default);
                let mig_current = info.mig_mode.is_some_and(|m| m.current);
                let physical = info.physical(info.spec(profiles.clone()));
                (
                    info.index,
                    Arc::new(Gpu {
                        info,
                        profiles,
                        policy,
                        physical,
                        rt: tokio::sync::Mutex::new(GpuRuntime { mig_current }),
                    }),
                )
            })
            .collect();
        let boot_id = std::fs::read_to_string(&config.boot_id_path)
            .map_err(|source| PluginError::Io {
                what: "reading boot id",
                path: config.boot_id_path.clone(),
                source,
            })?
            .trim()
            .to_string();
        let gpus: BTreeMap<u32, Arc<Gpu>> = gpus;
        let version = gpus.values().next().map(|g| g.info.driver_version.clone());
        let needs_caps = gpus.values().any(|g| g.info.mig_capable);
        let node_driver = NodeDriver::discover(&config.driver, version.as_deref());
        log_driver(&node_driver, needs_caps, None);
        Ok(Self {
            node_driver: std::sync::RwLock::new(Arc::new(node_driver)),
            config: Arc::new(config),
            backend,
            client,
            gpus,
            state: tokio::sync::Mutex::new(CheckpointBody {
                boot_id: boot_id.clone(),
                ..Default::default()
            }),
            claim_locks: std::sync::Mutex::default(),
            host_mutex: Arc::default(),
            boot_id,
            disk: std::sync::Mutex::new(DiskCopy::unknown()),
            status_writes: std::sync::Mutex::default(),
            api_calls: Arc::new(tokio::sync::Semaphore::new(API_CONCURRENCY)),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// A copy of the in-memory checkpoint body.
    pub async fn snapshot(&self) -> CheckpointBody {
        self.state.lock().await.clone()
    }

    fn claim_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self
            .claim_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.entry(uid.to_string()).or_default().clone()
    }

    fn drop_claim_lock(&self, uid: &str) {
        let mut m = self
            .claim_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(l) = m.get(uid)
            && Arc::strong_count(l) == 1
        {
            m.remove(uid);
        }
    }

    fn disk(&self) -> std::sync::MutexGuard<'_, DiskCopy> {
        self.disk
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Note what the checkpoint file now holds: written by this process
    /// (`Source::Written`: the file it replaced is the spare now) or read
    /// after another process wrote it (whose spare this process knows
    /// nothing about).
    fn remember(&self, bytes: Arc<[u8]>, body: &CheckpointBody, source: Source) {
        let mut d = self.disk();
        d.spare_records_mig = match source {
            Source::Written => d.records_mig,
            Source::Read => true,
        };
        d.records_mig = !body.mig_enabled_by_plugin.is_empty();
        if self.config.pod_uid.is_some() {
            d.file = Some((bytes, body.clone()));
        }
    }

    /// Write the checkpoint: serialized here, fsynced only when the new body
    /// or the file it replaces (or the spare it overwrites) records a GPU
    /// whose MIG mode the plugin enabled (the only state in it that a reboot
    /// does not undo; see the `checkpoint` module docs).
    async fn persist(&self, body: &CheckpointBody) -> Result<(), CheckpointError> {
        let path = self.config.checkpoint_path.clone();
        let (bytes, durable) = self.encode(body)?;
        let fault = self.config.write_fault;
        let b = bytes.clone();
        on_disk(durable, move || {
            checkpoint::store_bytes(&b, &path, durable, fault)
        })
        .await
        .map_err(|e| CheckpointError::Io {
            path: self.config.checkpoint_path.clone(),
            source: std::io::Error::other(e),
        })??;
        self.written(bytes, body);
        Ok(())
    }

    /// [`Self::persist`] after `first` (another file write), on the same
    /// thread; nothing is written to the checkpoint if `first` fails.
    async fn persist_after(
        &self,
        body: &CheckpointBody,
        first: impl FnOnce() -> Result<(), ClaimError> + Send + 'static,
    ) -> Result<(), ClaimError> {
        let path = self.config.checkpoint_path.clone();
        let (bytes, durable) = self.encode(body)?;
        let fault = self.config.write_fault;
        let b = bytes.clone();
        on_disk(durable, move || -> Result<(), ClaimError> {
            first()?;
            Ok(checkpoint::store_bytes(&b, &path, durable, fault)?)
        })
        .await
        .map_err(ClaimError::Task)??;
        self.written(bytes, body);
        Ok(())
    }

    /// The file's bytes for `body`, and whether writing them must be durable.
    fn encode(&self, body: &CheckpointBody) -> Result<(Arc<[u8]>, bool), CheckpointError> {
        let bytes = checkpoint::encode_body(body, &self.config.checkpoint_path)?.into();
        let d = self.disk();
        let durable =
            !body.mig_enabled_by_plugin.is_empty() || d.records_mig || d.spare_records_mig;
        Ok((bytes, durable))
    }

    fn written(&self, bytes: Arc<[u8]>, body: &CheckpointBody) {
        self.remember(bytes, body, Source::Written);
        if let Some(m) = &self.config.metrics {
            m.inc_checkpoint_writes();
        }
    }

    /// Set the GI/CI gauges of the MIG-capable GPUs among `gpus` from NVML
    /// (only with metrics configured), on a blocking thread. A failed read
    /// leaves the gauge as it was.
    async fn record_instances(&self, gpus: impl IntoIterator<Item = u32>) {
        if let Some(job) = self.instance_gauges(gpus) {
            let b = self.backend.clone();
            let _ = blocking(move || job.run(&*b)).await;
        }
    }

    /// What [`Self::record_instances`] does, to run inside a blocking hop
    /// that already holds the GPUs' locks (prepare's and unprepare's
    /// hardware steps): `None` without metrics or MIG-capable GPUs.
    fn instance_gauges(&self, gpus: impl IntoIterator<Item = u32>) -> Option<InstanceGauges> {
        let metrics = self.config.metrics.clone()?;
        let targets: Vec<(u32, String, carve_model::GpuSpec)> = gpus
            .into_iter()
            .filter_map(|g| self.gpus.get(&g))
            .filter(|g| g.info.mig_capable && !g.profiles.is_empty())
            .map(|g| {
                (
                    g.info.index,
                    g.info.uuid.clone(),
                    g.info.spec(g.profiles.clone()),
                )
            })
            .collect();
        (!targets.is_empty()).then_some(InstanceGauges { metrics, targets })
    }

    /// With a pod UID (rolling update: two plugin pods may run at once) every
    /// operation holds an exclusive lock on `<checkpoint>.lock` and first
    /// reloads the checkpoint another pod may have written. Without one, the
    /// in-memory state is authoritative and no file lock is taken.
    ///
    /// The reload reads the file's bytes; when they are exactly the bytes
    /// this process last wrote or read, the in-memory state is reset to the
    /// body it kept for them (as parsing them would) without parsing and
    /// verifying them again. Only a file another process wrote is parsed.
    ///
    /// This process's operations queue on an async mutex first, so at most one
    /// blocking thread ever waits in `flock` (the others wait as tasks): with
    /// the blocking pool bounded, claims that all waited in `flock` would leave
    /// the lock holder no thread for its NVML and file work, and nothing would
    /// move.
    async fn host_lock(&self) -> std::io::Result<Option<HostLock>> {
        if self.config.pod_uid.is_none() {
            return Ok(None);
        }
        let local = self.host_mutex.clone().lock_owned().await;
        let mut name = self.config.checkpoint_path.as_os_str().to_owned();
        name.push(".lock");
        let path = PathBuf::from(name);
        let cp = self.config.checkpoint_path.clone();
        let known = self.disk().file.clone();
        let reread = move |f: std::fs::File| {
            let loaded = match checkpoint::read_bytes(&cp) {
                Ok(Some(bytes)) => match known {
                    Some((k, body)) if *k == *bytes => Ok(Reread::Unchanged(body)),
                    _ => Checkpoint::decode(&cp, &bytes)
                        .map(|c| Reread::Changed(bytes.into(), Box::new(c))),
                },
                Ok(None) => Ok(Reread::Missing),
                Err(e) => Err(e),
            };
            (f, loaded)
        };
        // Opening, an uncontended lock and rereading a file of a few KB are
        // a handful of syscalls: done here. Only a lock held by the other
        // plugin pod of a rolling update is waited for, on a blocking thread.
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        };
        // The directory is made when the lock file cannot be (the first
        // time, or after an administrator removed it), not on every call.
        let f = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                open()?
            }
            r => r?,
        };
        let (file, loaded) = match f.try_lock() {
            Ok(()) => reread(f),
            Err(std::fs::TryLockError::WouldBlock) => blocking(move || -> std::io::Result<_> {
                f.lock()?;
                Ok(reread(f))
            })
            .await
            .map_err(std::io::Error::other)??,
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        };
        let body = match loaded {
            Ok(Reread::Unchanged(body)) => Some(body),
            Ok(Reread::Changed(bytes, c)) => {
                self.remember(bytes, &c.body, Source::Read);
                Some(c.body)
            }
            Ok(Reread::Missing) => None,
            Err(e) => {
                tracing::warn!(error = %e, "reloading checkpoint under the host lock failed; keeping in-memory state");
                None
            }
        };
        if let Some(body) = body {
            let mut st = self.state.lock().await;
            let boot_id = std::mem::take(&mut st.boot_id);
            *st = CheckpointBody { boot_id, ..body };
        }
        Ok(Some(HostLock {
            _file: file,
            _local: local,
        }))
    }

    /// The CDI device name of a prepared device: `<claim>-<device>`, and for an
    /// MPS share `<claim>-<device>-<shareID>` (one per share, since each share
    /// has its own limits).
    fn cdi_name(rec_uid: &str, d: &DeviceRecord) -> Result<String, CdiError> {
        match (d.kind.mps(), &d.share_id) {
            (Some(_), Some(s)) => cdi::device_name(rec_uid, &format!("{}-{s}", d.device)),
            _ => cdi::device_name(rec_uid, &d.device),
        }
    }

    fn prepared_devices(rec: &ClaimRecord) -> Vec<PreparedDevice> {
        rec.devices
            .iter()
            .map(|d| PreparedDevice {
                request_names: d.requests.clone(),
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: Self::cdi_name(&rec.uid, d)
                    .map(|n| vec![cdi::qualified(&n)])
                    .unwrap_or_default(),
                share_id: d.share_id.clone(),
            })
            .collect()
    }

    /// The claim's CDI spec: the driver's files once (spec level), each
    /// device's nodes (the GPU node, for MIG the GI and CI capability nodes
    /// with the `nvidia-caps` major and the capability files' mode), MPS
    /// share edits per share.
    fn cdi_spec_for(
        rec: &ClaimRecord,
        nd: &NodeDriver,
        proc_driver_nvidia: &std::path::Path,
    ) -> Result<CdiSpec, ClaimError> {
        let files = nd.files.clone()?;
        let mut devs = Vec::new();
        let mut seen = BTreeSet::new();
        for d in &rec.devices {
            let name = Self::cdi_name(&rec.uid, d)?;
            if !seen.insert(name.clone()) {
                continue;
            }
            let mut caps = Vec::new();
            if let PreparedKind::Mig {
                gi, ci, cap_minors, ..
            } = &d.kind
                && !cap_minors.is_empty()
            {
                let major = nd.caps_major.clone()?;
                let gi = gi.unwrap_or_default();
                for (minor, ci) in cap_minors.iter().zip([None, *ci]) {
                    let mode =
                        crate::driver_root::cap_mode(proc_driver_nvidia, d.gpu_minor, gi, ci)
                            .map_err(Arc::new)?;
                    caps.push(crate::driver_root::cap_node(major, *minor, mode));
                }
            }
            let mut container_edits = cdi::device_edits(
                files.gpu_node(d.gpu_minor),
                caps,
                d.capabilities_env.clone(),
            );
            if let Some(e) = d.kind.mps().and_then(|s| s.edits.as_ref()) {
                cdi::add_share(&mut container_edits, e);
            }
            devs.push(CdiDevice {
                name,
                container_edits,
            });
        }
        Ok(CdiSpec::new(devs, files.common.clone()))
    }

    /// The node's driver for a prepare: the last discovery while it is
    /// healthy, else a new one (NVML's driver version read again). An error
    /// names what is missing when the driver's files are not found, or when
    /// the claim has MIG devices and the `nvidia-caps` major is not found:
    /// checked before anything is changed for the claim.
    async fn node_driver(&self, planned: &[Planned]) -> Result<Arc<NodeDriver>, ClaimError> {
        let cur = self
            .node_driver
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let needs_caps = self.gpus.values().any(|g| g.info.mig_capable);
        let nd = if cur.healthy(needs_caps) {
            cur
        } else {
            let b = self.backend.clone();
            let version = blocking(move || {
                b.gpus()
                    .map(|g| g.first().map(|g| g.driver_version.clone()))
            })
            .await
            .map_err(ClaimError::Task)?
            .map_err(|source| ClaimError::Backend {
                op: "read the driver version".into(),
                source,
            })?;
            let cfg = self.config.driver.clone();
            let nd = Arc::new(
                blocking(move || NodeDriver::discover(&cfg, version.as_deref()))
                    .await
                    .map_err(ClaimError::Task)?,
            );
            log_driver(&nd, needs_caps, Some(&cur));
            *self
                .node_driver
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = nd.clone();
            nd
        };
        nd.files.clone()?;
        if planned
            .iter()
            .any(|p| matches!(p.record.kind, PreparedKind::Mig { .. }))
        {
            nd.caps_major.clone()?;
        }
        Ok(nd)
    }

    fn current_node_driver(&self) -> Arc<NodeDriver> {
        self.node_driver
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// PCI bus ids by GPU index.
    fn pci_map(&self) -> BTreeMap<u32, String> {
        self.gpus
            .iter()
            .map(|(i, g)| (*i, g.info.pci_bus_id.clone()))
            .collect()
    }

    /// MIG-MPS units that claims other than `except` hold, with one of their
    /// device records (which knows the instance).
    fn shared_units(st: &CheckpointBody, except: &str) -> BTreeMap<String, DeviceRecord> {
        let mut out = BTreeMap::new();
        for c in st.claims.values().filter(|c| c.uid != except) {
            for d in &c.devices {
                if let PreparedKind::Mig { mps: Some(s), .. } = &d.kind {
                    out.entry(s.unit.clone()).or_insert_with(|| d.clone());
                }
            }
        }
        out
    }

    /// The `carve_mps_daemons` gauge: units with at least one prepared share.
    fn record_mps(&self, st: &CheckpointBody) {
        if let Some(m) = &self.config.metrics {
            let units: BTreeSet<&str> = st
                .claims
                .values()
                .flat_map(|c| c.devices.iter())
                .filter_map(|d| d.kind.mps().map(|s| s.unit.as_str()))
                .collect();
            m.set_mps_daemons(units.len() as u64);
        }
    }

    /// The setup for a record's MPS shares; an error when the plugin runs without MPS.
    fn mps_setup(&self, devices: &[DeviceRecord]) -> Result<Option<MpsSetup>, ClaimError> {
        match devices.iter().find(|d| d.kind.mps().is_some()) {
            None => Ok(None),
            Some(d) => self
                .config
                .mps
                .clone()
                .map(Some)
                .ok_or_else(|| ClaimError::MpsDisabled {
                    device: d.device.clone(),
                }),
        }
    }

    /// Prepare claims concurrently; every claim gets a result.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let futs = claims.into_iter().map(|c| async move {
            let t = std::time::Instant::now();
            let r = self.prepare_one(&c).await;
            if let Err(e) = &r {
                tracing::warn!(claim.uid = %c.uid, claim = %c, error = %e, "prepare failed");
            }
            if let Some(m) = &self.config.metrics {
                m.observe_prepare(
                    t.elapsed(),
                    r.as_ref()
                        .map(|_| ())
                        .map_err(crate::metrics::failure_reason),
                );
            }
            (c, r)
        });
        futures::future::join_all(futs).await
    }

    /// Unprepare claims concurrently; every claim gets a result.
    pub async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let futs = claims.into_iter().map(|c| async move {
            let t = std::time::Instant::now();
            let r = self.unprepare_one(&c.uid).await;
            if let Err(e) = &r {
                tracing::warn!(claim.uid = %c.uid, claim = %c, error = %e, "unprepare failed");
            }
            if let Some(m) = &self.config.metrics {
                m.observe_unprepare(
                    t.elapsed(),
                    r.as_ref()
                        .map(|_| ())
                        .map_err(crate::metrics::failure_reason),
                );
            }
            (c, r)
        });
        futures::future::join_all(futs).await
    }

    /// Prepare one claim (idempotent).
    ///
    /// # Errors
    /// See [`ClaimError`]; on error nothing stays created.
    pub async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        let lock = self.claim_lock(&claim.uid);
        let guard = lock.lock().await;
        let r = self.prepare_locked(claim).await;
        drop(guard);
        drop(lock);
        self.drop_claim_lock(&claim.uid);
        r
    }

    async fn prepare_locked(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        // The claim GET runs while the host lock is taken (and the checkpoint
        // reread): the allocation it reads is not guarded by that lock, and
        // its result is used only once the lock is held. For a claim found
        // prepared already the result is ignored (one wasted GET).
        // A claim found prepared answers from the checkpoint without waiting
        // for the GET (an API server that does not answer must not hold it
        // up); any other claim waits for it, [`PluginConfig::api_timeout`]
        // at most.
        let api: Api<ReadClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let mut get = std::pin::pin!(crate::api::bounded(
            &self.api_calls,
            self.config.api_timeout,
            api.get_opt(&claim.name),
        ));
        let mut host_lock = std::pin::pin!(self.host_lock());
        let mut got = None;
        let host = tokio::select! {
            h = &mut host_lock => h,
            g = &mut get => {
                got = Some(g);
                host_lock.await
            }
        };
        let _host = host.map_err(|source| {
            ClaimError::Checkpoint(CheckpointError::Io {
                path: self.config.checkpoint_path.clone(),
                source,
            })
        })?;
        if let Some(rec) = self.state.lock().await.claims.get(&claim.uid)
            && rec.state == ClaimState::PrepareCompleted
        {
            return Ok(Self::prepared_devices(rec));
        }
        let got = match got {
            Some(g) => g,
            None => get.await,
        };
        let rc = got
            .map_err(|e| ClaimError::Kube {
                what: "get ResourceClaim".into(),
                source: Box::new(e),
            })?
            .ok_or_else(|| ClaimError::NotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?
            .0;
        let found = rc.metadata.uid.clone().unwrap_or_default();
        if found != claim.uid {
            return Err(ClaimError::Replaced {
                expected: claim.uid.clone(),
                found,
            });
        }
        let planned = self.plan(&rc)?;
        self.node_driver(&planned).await?;
        let pods: Vec<String> = rc
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .map(|v| {
                v.iter()
                    .filter(|r| {
                        r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty()
                    })
                    .map(|r| r.uid.clone())
                    .collect()
            })
            .unwrap_or_default();
        let result = self.execute(claim, planned, &pods).await;
        if let Ok(devs) = &result {
            self.start_status_write(api.clone(), &rc, claim).await;
            tracing::info!(claim.uid = %claim.uid, claim = %claim, devices = devs.len(), "prepared");
        }
        result
    }

    fn plan(&self, rc: &ResourceClaim) -> Result<Vec<Planned>, ClaimError> {
        plan_claim(&self.config, &self.gpus, rc)
    }

    /// Check occupancy, record PrepareStarted, make the instances, write CDI and
    /// PrepareCompleted. Rolls back on failure.
    async fn execute(
        &self,
        claim: &ClaimRef,
        planned: Vec<Planned>,
        pods: &[String],
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let gpu_ids: BTreeSet<u32> = planned.iter().map(|p| p.record.gpu_index).collect();
        let mut guards = Vec::new();
        for id in &gpu_ids {
            guards.push((*id, self.gpus[id].rt.lock().await));
        }
        // Snapshot NVML state of the involved MIG GPUs: instances and MIG mode
        // (read fresh: an administrator or another plugin pod may change it).
        let ids: Vec<u32> = gpu_ids
            .iter()
            .copied()
            .filter(|g| self.gpus[g].info.mig_capable)
            .collect();
        let mps_gpus: Vec<u32> = planned
            .iter()
            .filter(|p| matches!(p.record.kind, PreparedKind::Mps { .. }))
            .map(|p| p.record.gpu_index)
            .collect();
        // The common case, MIG instances without MPS on GPUs last seen in MIG
        // mode: one blocking hop reads the GPUs, checks the placements against
        // them and creates the instances. A GPU found out of MIG mode after
        // all (changed behind the plugin's back) sends the claim down the
        // general path below with what was read, before anything is created.
        let fast = planned
            .iter()
            .all(|p| matches!(p.record.kind, PreparedKind::Mig { mps: None, .. }))
            && guards
                .iter()
                .all(|(g, rt)| rt.mig_current && self.gpus[g].info.mig_capable);
        let mut read: Option<Snapshot> = None;
        let mut made = None;
        if fast {
            {
                let mut st = self.state.lock().await;
                self.check_claims(claim, &planned, &st)?;
                st.claims
                    .insert(claim.uid.clone(), Self::started(claim, &planned));
            }
            let b = self.backend.clone();
            let retry = self.config.unprepare_retry;
            let ids = ids.clone();
            let gpus: BTreeMap<u32, Arc<Gpu>> =
                ids.iter().map(|g| (*g, self.gpus[g].clone())).collect();
            let mut records: Vec<DeviceRecord> = planned.iter().map(|p| p.record.clone()).collect();
            let gauges = self.instance_gauges(gpu_ids.iter().copied());
            let r = blocking(move || {
                let snap = match read_gpus(&*b, &ids) {
                    Ok(s) => s,
                    Err(e) => return Fast::Refused(e),
                };
                if snap.values().any(|(_, mig_on)| !mig_on) {
                    return Fast::Slow(snap);
                }
                let live: BTreeMap<u32, Vec<GpuInstanceInfo>> =
                    snap.into_iter().map(|(g, (v, _))| (g, v)).collect();
                if let Err(e) = check_live(&records, &live, &gpus, |_| false) {
                    return Fast::Refused(e);
                }
                let r = make_devices(
                    &*b,
                    retry,
                    (&[], &[]),
                    &mut records,
                    &live,
                    &BTreeMap::new(),
                );
                if let Some(g) = &gauges {
                    g.run(&*b);
                }
                Fast::Done(r, records)
            })
            .await;
            match r {
                Ok(Fast::Done(r, records)) => made = Some((r, records)),
                Ok(Fast::Slow(snap)) => {
                    // The general path checks and records the claim itself.
                    self.state.lock().await.claims.remove(&claim.uid);
                    read = Some((snap, BTreeMap::new()));
                }
                Ok(Fast::Refused(e)) => {
                    self.state.lock().await.claims.remove(&claim.uid);
                    return Err(e);
                }
                Err(e) => {
                    self.state.lock().await.claims.remove(&claim.uid);
                    return Err(ClaimError::Task(e));
                }
            }
        }
        let (hw, shared, modes) = match made {
            Some(made) => (Ok(made), BTreeMap::new(), BTreeMap::new()),
            None => {
                self.general_path(claim, planned, &mut guards, (ids, mps_gpus, &gpu_ids), read)
                    .await?
            }
        };
        let keep: BTreeSet<String> = shared.keys().cloned().collect();
        let (hw, records) = match hw {
            Ok(x) => x,
            Err(e) => return Err(ClaimError::Task(e)),
        };
        let (mig_now, mig_off): (Vec<u32>, Vec<u32>) = match hw {
            Ok(x) => x,
            Err(e) => {
                let mut st = self.state.lock().await;
                st.claims.remove(&claim.uid);
                prune_compute_modes(&mut st);
                if let Err(pe) = self.persist(&st).await {
                    tracing::error!(claim.uid = %claim.uid, error = %pe, "checkpoint after rollback");
                }
                return Err(e);
            }
        };
        for (g, rt) in &mut guards {
            if mig_now.contains(g) {
                rt.mig_current = true;
            }
            if mig_off.contains(g) {
                rt.mig_current = false;
            }
        }

        // MPS: attach the shares to their daemons (starting them as needed).
        let mut compute_set = Vec::new();
        let records = match self.mps_setup(&records) {
            Ok(None) => records,
            Ok(Some(setup)) => {
                let b = self.backend.clone();
                let uid = claim.uid.clone();
                let pods = pods.to_vec();
                let pci = self.pci_map();
                let mut recs = records;
                let r = blocking(move || {
                    let cx = crate::mps::AttachCtx {
                        setup: &setup,
                        backend: &*b,
                        claim_uid: &uid,
                        pods: &pods,
                        pci: &pci,
                        gpu_modes: &modes,
                    };
                    let r = crate::mps::attach(&cx, &mut recs);
                    (r, recs)
                })
                .await;
                match r {
                    Ok((Ok(a), recs)) => {
                        compute_set = a.compute_mode_set;
                        recs
                    }
                    Ok((Err(e), recs)) => {
                        self.undo_prepare(claim, recs, &keep).await;
                        return Err(e);
                    }
                    Err(e) => return Err(ClaimError::Task(e)),
                }
            }
            Err(e) => {
                self.undo_prepare(claim, records, &keep).await;
                return Err(e);
            }
        };

        // CDI, then PrepareCompleted.
        let mut rec = ClaimRecord {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::PrepareCompleted,
            cdi_spec: Some(cdi::claim_spec_path(&self.config.cdi_dir, &claim.uid)),
            devices: records,
        };
        let finish = async {
            let spec = Self::cdi_spec_for(
                &rec,
                &self.current_node_driver(),
                &self.config.driver.proc_driver_nvidia,
            )?;
            let path = rec.cdi_spec.clone().unwrap_or_default();
            let fault = self.config.write_fault;
            let mut st = self.state.lock().await;
            let compute_before = st.compute_mode_set_by_plugin.clone();
            let prev = st.claims.insert(claim.uid.clone(), rec.clone());
            st.compute_mode_set_by_plugin
                .extend(compute_set.iter().cloned());
            // The spec, then the checkpoint that records it, on one blocking
            // thread; the spec first, so a completed claim always has one.
            let written = self
                .persist_after(&st, move || Ok(spec.write(&path, fault)?))
                .await;
            if let Err(e) = written {
                match prev {
                    Some(p) => st.claims.insert(claim.uid.clone(), p),
                    None => st.claims.remove(&claim.uid),
                };
                st.compute_mode_set_by_plugin = compute_before;
                return Err(e);
            }
            Ok::<_, ClaimError>(())
        };
        if let Err(e) = finish.await {
            // Undo the shares, the hardware and the spec; keep the claim unprepared.
            if let Some(p) = rec.cdi_spec.take() {
                let _ = cdi::remove(&p);
            }
            self.undo_prepare(claim, rec.devices.clone(), &keep).await;
            return Err(e);
        }
        drop(guards);
        self.record_mps(&*self.state.lock().await);
        Ok(Self::prepared_devices(&rec))
    }

    /// Prepare's general path, from reading the GPUs (unless `read` holds
    /// what the one-hop path read) to making the devices: checks, MIG mode
    /// and compute mode decisions, the PrepareStarted intent where they
    /// change node state. Returns the hardware step's outcome, the shared MPS
    /// units and the compute modes read.
    async fn general_path(
        &self,
        claim: &ClaimRef,
        planned: Vec<Planned>,
        guards: &mut [(u32, tokio::sync::MutexGuard<'_, GpuRuntime>)],
        (ids, mps_gpus, gpu_ids): (Vec<u32>, Vec<u32>, &BTreeSet<u32>),
        read: Option<Snapshot>,
    ) -> Result<(Result<Made, String>, BTreeMap<String, DeviceRecord>, Modes), ClaimError> {
        let b = self.backend.clone();
        // One blocking hop for every read.
        let (snap, modes): Snapshot = if let Some(r) = read {
            r
        } else {
            blocking(move || {
                let snap = read_gpus(&*b, &ids)?;
                let modes = mps_gpus
                    .into_iter()
                    .map(|g| {
                        b.compute_mode(carve_gpu::ComputeTarget::Gpu(g))
                            .map(|m| (g, m))
                            .map_err(backend_err(format!("read compute mode of GPU {g}")))
                    })
                    .collect::<Result<_, ClaimError>>()?;
                Ok::<_, ClaimError>((snap, modes))
            })
            .await
            .map_err(ClaimError::Task)??
        };
        for (g, rt) in guards.iter_mut() {
            if let Some((_, current)) = snap.get(g) {
                rt.mig_current = *current;
            }
        }
        let live: BTreeMap<u32, Vec<GpuInstanceInfo>> =
            snap.into_iter().map(|(g, (v, _))| (g, v)).collect();

        let mut enable_mig: Vec<u32> = Vec::new();
        let mut disable_mig: Vec<u32> = Vec::new();
        let shared;
        {
            let mut st = self.state.lock().await;
            self.check_occupancy(claim, &planned, &live, &st, guards)?;
            let node_state_before = (
                st.mig_enabled_by_plugin.clone(),
                st.compute_mode_set_by_plugin.clone(),
            );
            shared = Self::shared_units(&st, &claim.uid);
            // A whole GPU whose first MPS share this is goes to EXCLUSIVE_PROCESS:
            // note it before touching it, so a crash in between still restores it.
            for (g, m) in &modes {
                let held = st.claims.values().any(|c| {
                    c.uid != claim.uid
                        && c.devices.iter().any(|d| {
                            d.gpu_index == *g && matches!(d.kind, PreparedKind::Mps { .. })
                        })
                });
                if !held && *m != carve_gpu::ComputeMode::ExclusiveProcess {
                    st.compute_mode_set_by_plugin
                        .insert(self.gpus[g].info.uuid.clone());
                }
            }
            for (g, rt) in guards.iter() {
                let gpu = &self.gpus[g];
                let wants_mig = planned.iter().any(|p| {
                    p.record.gpu_index == *g && matches!(p.record.kind, PreparedKind::Mig { .. })
                });
                if wants_mig && !rt.mig_current {
                    if gpu.policy == GpuPolicy::Static {
                        // A static GPU with MIG off has no instances to hand out.
                        let p = planned
                            .iter()
                            .find(|p| p.record.gpu_index == *g)
                            .map(|p| p.record.clone());
                        if let Some(DeviceRecord {
                            device,
                            kind:
                                PreparedKind::Mig {
                                    profile, placement, ..
                                },
                            ..
                        }) = p
                        {
                            return Err(ClaimError::StaticMissing {
                                device,
                                gpu: *g,
                                profile,
                                placement,
                            });
                        }
                    }
                    if gpu.info.architecture.mig_mode_needs_reset() {
                        return Err(ClaimError::MigPending { gpu: *g });
                    }
                    enable_mig.push(*g);
                    st.mig_enabled_by_plugin.insert(gpu.info.uuid.clone());
                }
                // A whole GPU (exclusive or shared) runs CUDA work only with
                // MIG mode off: turn it off where that needs no reset (no
                // instance exists: checked above); the next MIG claim turns it
                // on again.
                let whole = planned.iter().find(|p| {
                    p.record.gpu_index == *g
                        && matches!(
                            p.record.kind,
                            PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. }
                        )
                });
                if let Some(w) = whole
                    && rt.mig_current
                {
                    let why = if gpu.policy == GpuPolicy::Static {
                        Some("its MIG policy is static")
                    } else if gpu.info.architecture.mig_mode_needs_reset() {
                        Some("leaving MIG mode needs a GPU reset on this architecture")
                    } else {
                        None
                    };
                    if let Some(why) = why {
                        return Err(ClaimError::WholeInMigMode {
                            device: w.record.device.clone(),
                            gpu: *g,
                            why,
                        });
                    }
                    disable_mig.push(*g);
                    st.mig_enabled_by_plugin.remove(&gpu.info.uuid);
                }
            }
            st.claims
                .insert(claim.uid.clone(), Self::started(claim, &planned));
            // PrepareStarted is persisted only when this prepare is about to
            // change node state that outlives the claim (MIG mode, compute
            // mode): recovery must know to put that back. Anything else a
            // crash before PrepareCompleted leaves is found without it: GPU
            // instances no completed claim owns are swept, CDI specs of
            // unknown claims removed, MPS shares of unknown claims dropped.
            let intent = node_state_before
                != (
                    st.mig_enabled_by_plugin.clone(),
                    st.compute_mode_set_by_plugin.clone(),
                );
            if intent && let Err(e) = self.persist(&st).await {
                st.claims.remove(&claim.uid);
                let (m, c) = node_state_before;
                st.mig_enabled_by_plugin = m;
                st.compute_mode_set_by_plugin = c;
                return Err(e.into());
            }
        }

        // Hardware.
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let mut records: Vec<DeviceRecord> = planned.into_iter().map(|p| p.record).collect();
        let live2 = live.clone();
        let shared2 = shared.clone();
        // The gauges are read in the same hop (an undo sets them again).
        let gauges = self.instance_gauges(gpu_ids.iter().copied());
        let hw = blocking(move || {
            let r = make_devices(
                &*b,
                retry,
                (&enable_mig, &disable_mig),
                &mut records,
                &live2,
                &shared2,
            );
            if let Some(g) = &gauges {
                g.run(&*b);
            }
            (r, records)
        })
        .await;
        Ok((hw, shared, modes))
    }

    /// Roll back a prepare after the hardware step: detach MPS shares, destroy
    /// the instances this claim made (not those shared with other claims'
    /// MPS shares in `keep`), forget the claim. Errors are logged: the
    /// original error is what the kubelet sees, and recovery sweeps leftovers.
    async fn undo_prepare(
        &self,
        claim: &ClaimRef,
        devs: Vec<DeviceRecord>,
        keep: &BTreeSet<String>,
    ) {
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let setup = self.config.mps.clone();
        let uid = claim.uid.clone();
        let pci = self.pci_map();
        let compute_set = self.state.lock().await.compute_mode_set_by_plugin.clone();
        let keep = keep.clone();
        let gauges = self.instance_gauges(devs.iter().map(|d| d.gpu_index));
        let r = blocking(move || {
            let r = (|| {
                if let Some(setup) = &setup {
                    crate::mps::detach(setup, &*b, &uid, &devs, &compute_set, &pci)?;
                }
                destroy_devices(&*b, retry, &devs, &keep)
            })();
            if let Some(g) = &gauges {
                g.run(&*b);
            }
            r
        })
        .await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(claim.uid = %claim.uid, error = %e, "rollback after a failed prepare")
            }
            Err(e) => {
                tracing::error!(claim.uid = %claim.uid, error = %e, "rollback after a failed prepare")
            }
        }
        let mut st = self.state.lock().await;
        st.claims.remove(&claim.uid);
        prune_compute_modes(&mut st);
        if let Err(e) = self.persist(&st).await {
            tracing::error!(claim.uid = %claim.uid, error = %e, "checkpoint after rollback");
        }
    }

    fn check_occupancy(
        &self,
        claim: &ClaimRef,
        planned: &[Planned],
        live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
        st: &CheckpointBody,
        _guards: &[(u32, tokio::sync::MutexGuard<'_, GpuRuntime>)],
    ) -> Result<(), ClaimError> {
        self.check_claims(claim, planned, st)?;
        // The instance of an MPS unit another claim already shares is expected.
        let shared = |d: &DeviceRecord| match &d.kind {
            PreparedKind::Mig { mps: Some(s), .. } => st.claims.values().any(|c| {
                c.uid != claim.uid
                    && c.devices.iter().any(|x| {
                        x.gpu_index == d.gpu_index && x.kind.mps().is_some_and(|o| o.unit == s.unit)
                    })
            }),
            _ => false,
        };
        check_live(planned.iter().map(|p| &p.record), live, &self.gpus, shared)
    }

    /// The in-memory record of a claim being prepared.
    fn started(claim: &ClaimRef, planned: &[Planned]) -> ClaimRecord {
        ClaimRecord {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::PrepareStarted,
            cdi_spec: None,
            devices: planned.iter().map(|p| p.record.clone()).collect(),
        }
    }

    /// The devices of `planned` that other claims' devices conflict with.
    fn check_claims(
        &self,
        claim: &ClaimRef,
        planned: &[Planned],
        st: &CheckpointBody,
    ) -> Result<(), ClaimError> {
        for p in planned {
            let d = &p.record;
            let g = d.gpu_index;
            // Other claims' devices on this GPU.
            for o in st.claims.values().filter(|c| c.uid != claim.uid) {
                let Some(x) = o
                    .devices
                    .iter()
                    .find(|x| x.gpu_index == g && conflicts(&d.kind, &x.kind))
                else {
                    continue;
                };
                let who = format!("{}/{} ({})", o.namespace, o.name, o.uid);
                return Err(match (&d.kind, &x.kind) {
                    (PreparedKind::Mig { placement, .. }, PreparedKind::Mig { .. }) => {
                        ClaimError::Occupied {
                            device: d.device.clone(),
                            gpu: g,
                            placement: *placement,
                            by: format!("claim {who}"),
                        }
                    }
                    (_, PreparedKind::Gpu) => ClaimError::GpuHeld {
                        device: d.device.clone(),
                        gpu: g,
                        by: format!("as a whole GPU by claim {who}"),
                    },
                    (_, k) => ClaimError::GpuHeld {
                        device: d.device.clone(),
                        gpu: g,
                        by: format!("by claim {who} {}", holds(k)),
                    },
                });
            }
        }
        Ok(())
    }

    /// Write the prepared devices to the claim's `status.devices` in the
    /// background. The kubelet does not wait for it: nothing it starts reads
    /// the status, which is there for people (`kubectl get resourceclaim -o
    /// yaml`) and tools. A failed write is logged; the claim stays prepared.
    /// The claim's unprepare waits for the write first ([`STATUS_SETTLE`]),
    /// so a write never lands after the devices it names are gone.
    async fn start_status_write(&self, api: Api<ReadClaim>, rc: &ResourceClaim, claim: &ClaimRef) {
        let Some(patch) = self.status_patch(rc, claim).await else {
            return;
        };
        let (name, uid, label) = (claim.name.clone(), claim.uid.clone(), claim.to_string());
        let permits = self.api_calls.clone();
        let timeout = self.config.api_timeout;
        let task = tokio::spawn(async move {
            let params = PatchParams::default();
            let patch = Patch::Merge(&patch);
            let write = api.patch_status(&name, &params, &patch);
            if let Err(e) = crate::api::bounded(&permits, timeout, write).await {
                tracing::warn!(claim.uid = %uid, claim = %label, error = %e, "writing device status failed; the claim stays prepared");
            }
        });
        let mut writes = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        writes.retain(|_, t| !t.is_finished());
        // Under the claim lock, and an unprepare takes the previous write
        // out: there is none for this claim.
        if let Some(old) = writes.insert(claim.uid.clone(), task) {
            old.abort();
        }
    }

    /// Wait for the claim's status write if one is in flight; abort it after
    /// [`STATUS_SETTLE`].
    async fn settle_status_write(&self, uid: &str) {
        let task = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(uid);
        if let Some(mut task) = task
            && tokio::time::timeout(STATUS_SETTLE, &mut task)
                .await
                .is_err()
        {
            task.abort();
            tracing::warn!(claim.uid = %uid, "status write still in flight after {STATUS_SETTLE:?}; aborted");
        }
    }

    /// Wait for every status write in flight ([`STATUS_SETTLE`] at most, then
    /// abort the rest): a stopping plugin calls this so that what it
    /// prepared is on the claims it prepared.
    pub async fn settle_status_writes(&self) {
        let tasks: Vec<_> = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .collect();
        let deadline = tokio::time::Instant::now() + STATUS_SETTLE;
        for (uid, mut task) in tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
                tracing::warn!(claim.uid = %uid, "status write still in flight at stop; aborted");
            }
        }
    }

    /// The merge patch of the claim's `status.devices`: other drivers'
    /// entries kept, this driver's replaced by what the claim now holds.
    async fn status_patch(
        &self,
        rc: &ResourceClaim,
        claim: &ClaimRef,
    ) -> Option<serde_json::Value> {
        let devices = {
            let st = self.state.lock().await;
            st.claims.get(&claim.uid)?.devices.clone()
        };
        let mut entries: Vec<serde_json::Value> = rc
            .status
            .as_ref()
            .and_then(|s| s.devices.as_ref())
            .map(|v| {
                v.iter()
                    .filter(|d| d.driver != self.config.driver_name)
                    .filter_map(|d| serde_json::to_value(d).ok())
                    .collect()
            })
            .unwrap_or_default();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let mps_caps = self.config.mps.as_ref().map(|m| m.support.capabilities());
        for d in &devices {
            let data = match &d.kind {
                PreparedKind::Gpu => serde_json::json!({"uuid": d.gpu_uuid}),
                PreparedKind::TimeSlice => {
                    serde_json::json!({"uuid": d.gpu_uuid, "sharing": "timeslice"})
                }
                PreparedKind::Mps { .. } => serde_json::json!({"uuid": d.gpu_uuid}),
                PreparedKind::Mig {
                    profile,
                    placement,
                    gi,
                    ci,
                    mig_uuid,
                    ..
                } => serde_json::json!({
                    "uuid": mig_uuid, "gpuUUID": d.gpu_uuid, "profile": profile,
                    "placement": {"start": placement.start, "size": placement.size},
                    "gpuInstanceID": gi, "computeInstanceID": ci,
                }),
            };
            let mut data = data;
            if let Some(share) = d.kind.mps() {
                data["sharing"] = serde_json::json!("mps");
                data["mps"] = serde_json::json!({
                    "unit": share.unit,
                    "memoryLimitMiB": share.limits.memory_limit_mib,
                    "multiprocessors": share.limits.multiprocessors,
                    "activeThreadPercentage": share.limits.active_thread_percentage,
                    "memoryLimit": mps_caps.map(|c| c.memory_limit.as_str()),
                    "computeLimit": mps_caps.map(|c| c.compute_limit.as_str()),
                    "cgroup": share.cgroup,
                });
            }
            let mut e = serde_json::json!({
                "driver": self.config.driver_name, "pool": d.pool, "device": d.device,
                "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                    "message": "prepared by the carve kubelet plugin", "lastTransitionTime": now}],
                "data": data,
            });
            if let Some(s) = &d.share_id {
                e["shareID"] = serde_json::json!(s);
            }
            entries.push(e);
        }
        Some(serde_json::json!({"status": {"devices": entries}}))
    }

    /// Unprepare one claim (idempotent: an unknown claim is done).
    ///
    /// # Errors
    /// Instances that stay in use, NVML or file errors; the claim then stays
    /// recorded and a retry continues where this one stopped.
    pub async fn unprepare_one(&self, uid: &str) -> Result<(), ClaimError> {
        let lock = self.claim_lock(uid);
        let guard = lock.lock().await;
        self.settle_status_write(uid).await;
        let _host = self.host_lock().await.map_err(|source| {
            ClaimError::Checkpoint(CheckpointError::Io {
                path: self.config.checkpoint_path.clone(),
                source,
            })
        })?;
        let rec = {
            let mut st = self.state.lock().await;
            let Some(rec) = st.claims.get_mut(uid) else {
                drop(st);
                drop(guard);
                drop(lock);
                self.drop_claim_lock(uid);
                return Ok(());
            };
            if rec.state != ClaimState::UnprepareStarted {
                rec.state = ClaimState::UnprepareStarted;
                let r = rec.clone();
                self.persist(&st).await?;
                r
            } else {
                rec.clone()
            }
        };
        let gpu_ids: BTreeSet<u32> = rec.devices.iter().map(|d| d.gpu_index).collect();
        let mut guards = Vec::new();
        for id in &gpu_ids {
            if let Some(g) = self.gpus.get(id) {
                guards.push((*id, g.rt.lock().await));
            }
        }
        // MPS shares first: a daemon's server holds the instance it serves.
        let (keep, compute_set) = {
            let st = self.state.lock().await;
            let keep: BTreeSet<String> = Self::shared_units(&st, uid).into_keys().collect();
            (keep, st.compute_mode_set_by_plugin.clone())
        };
        let mut restored = Vec::new();
        if let Some(setup) = self.mps_setup(&rec.devices)? {
            let b = self.backend.clone();
            let devs = rec.devices.clone();
            let u = uid.to_string();
            let pci = self.pci_map();
            restored =
                blocking(move || crate::mps::detach(&setup, &*b, &u, &devs, &compute_set, &pci))
                    .await
                    .map_err(ClaimError::Task)??;
        }
        // The instances, the gauges, then the CDI spec, on one blocking thread.
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let devs = rec.devices.clone();
        let spec = rec.cdi_spec.clone();
        let gauges = self.instance_gauges(gpu_ids.iter().copied());
        blocking(move || -> Result<(), ClaimError> {
            let destroyed = destroy_devices(&*b, retry, &devs, &keep);
            if let Some(g) = &gauges {
                g.run(&*b);
            }
            destroyed?;
            if let Some(p) = &spec {
                cdi::remove(p)?;
            }
            Ok(())
        })
        .await
        .map_err(ClaimError::Task)??;
        // The claim is gone; then return MIG mode where the plugin turned it
        // on and nothing is left (GPU locks still held, checkpoint lock not
        // held across NVML).
        let restore: Vec<u32> = {
            let mut st = self.state.lock().await;
            st.claims.remove(uid);
            for u in &restored {
                st.compute_mode_set_by_plugin.remove(u);
            }
            self.persist(&st).await?;
            self.record_mps(&st);
            guards
                .iter()
                .map(|(g, _)| *g)
                .filter(|g| {
                    let gpu = &self.gpus[g];
                    st.mig_enabled_by_plugin.contains(&gpu.info.uuid)
                        && !gpu.info.architecture.mig_mode_needs_reset()
                        && !st
                            .claims
                            .values()
                            .any(|c| c.devices.iter().any(|d| d.gpu_index == *g))
                })
                .collect()
        };
        let mut disabled = Vec::new();
        for (g, rt) in &mut guards {
            if !restore.contains(g) {
                continue;
            }
            let b = self.backend.clone();
            let gi = *g;
            let r = blocking(move || -> Result<bool, BackendError> {
                if b.gpu_instances(gi)?.is_empty() {
                    b.set_mig_mode(gi, false)?;
                    Ok(true)
                } else {
                    Ok(false)
                }
            })
            .await
            .map_err(ClaimError::Task)?;
            match r {
                Ok(true) => {
                    rt.mig_current = false;
                    disabled.push(self.gpus[g].info.uuid.clone());
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(gpu = gi, error = %e, "disabling MIG mode failed"),
            }
        }
        if !disabled.is_empty() {
            let mut st = self.state.lock().await;
            for u in &disabled {
                st.mig_enabled_by_plugin.remove(u);
            }
            self.persist(&st).await?;
        }
        drop(guards);
        drop(guard);
        drop(lock);
        self.drop_claim_lock(uid);
        tracing::info!(claim.uid = %uid, "unprepared");
        Ok(())
    }

    /// Unprepare claims whose ResourceClaim is gone or has another UID.
    /// Returns the UIDs cleaned up.
    pub async fn gc_once(&self) -> Vec<String> {
        let claims: Vec<ClaimRecord> = {
            let st = self.state.lock().await;
            st.claims
                .values()
                .filter(|c| c.state == ClaimState::PrepareCompleted)
                .cloned()
                .collect()
        };
        let mut done = Vec::new();
        for c in claims {
            let api: Api<ReadClaim> = Api::namespaced(self.client.clone(), &c.namespace);
            let get = api.get_opt(&c.name);
            let stale =
                match crate::api::bounded(&self.api_calls, self.config.api_timeout, get).await {
                    Ok(None) => true,
                    Ok(Some(ReadClaim(rc))) => rc.metadata.uid.as_deref() != Some(c.uid.as_str()),
                    Err(e) => {
                        tracing::warn!(claim.uid = %c.uid, error = %e, "GC: reading claim failed");
                        false
                    }
                };
            if stale {
                match self.unprepare_one(&c.uid).await {
                    Ok(()) => done.push(c.uid),
                    Err(e) => {
                        tracing::warn!(claim.uid = %c.uid, error = %e, "GC: unprepare failed")
                    }
                }
            }
        }
        done
    }

    /// Converge from NVML truth and the checkpoint; see the crate docs.
    ///
    /// # Errors
    /// NVML or file failures that leave the state unknown.
    pub async fn recover(&self) -> Result<RecoveryReport, PluginError> {
        let mut report = RecoveryReport::default();
        let path = self.config.checkpoint_path.clone();
        let _host = self.host_lock().await.map_err(|source| PluginError::Io {
            what: "locking checkpoint",
            path: path.clone(),
            source,
        })?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| PluginError::Io {
                what: "creating checkpoint directory",
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::create_dir_all(&self.config.cdi_dir).map_err(|source| PluginError::Io {
            what: "creating CDI directory",
            path: self.config.cdi_dir.clone(),
            source,
        })?;
        let mut rebuild = false;
        let mut body = match Checkpoint::load(&path) {
            Ok(Some(c)) if c.body.boot_id == self.boot_id => c.body,
            Ok(Some(c)) => {
                tracing::warn!(old = %c.body.boot_id, new = %self.boot_id, "checkpoint from another boot: discarded");
                report.discarded_other_boot = true;
                CheckpointBody {
                    boot_id: self.boot_id.clone(),
                    mig_enabled_by_plugin: c.body.mig_enabled_by_plugin,
                    claims: BTreeMap::new(),
                    // Compute modes do not survive a reboot.
                    compute_mode_set_by_plugin: BTreeSet::new(),
                }
            }
            Ok(None) => CheckpointBody {
                boot_id: self.boot_id.clone(),
                ..Default::default()
            },
            Err(e) => {
                let aside = move_aside(&path).map_err(|source| PluginError::Io {
                    what: "moving corrupt checkpoint aside",
                    path: path.clone(),
                    source,
                })?;
                report.moved_aside = Some(aside.clone());
                match checkpoint::read_boot_marker(&path) {
                    // Recovery ran in an earlier boot, so the file was last
                    // written then: a write that was not fsynced, torn by the
                    // power loss, and one that recorded nothing a reboot
                    // does not undo (`checkpoint` module docs).
                    Some(old) if old != self.boot_id => {
                        tracing::warn!(error = %e, aside = %aside.display(), old = %old, new = %self.boot_id, "unusable checkpoint from another boot moved aside and discarded");
                        report.discarded_other_boot = true;
                    }
                    _ => {
                        tracing::error!(error = %e, aside = %aside.display(), "unusable checkpoint moved aside; rebuilding from NVML and the API server");
                        rebuild = true;
                    }
                }
                CheckpointBody {
                    boot_id: self.boot_id.clone(),
                    ..Default::default()
                }
            }
        };

        // NVML truth.
        let b = self.backend.clone();
        let ids: Vec<u32> = self
            .gpus
            .values()
            .filter(|g| g.info.mig_capable)
            .map(|g| g.info.index)
            .collect();
        let mut live: BTreeMap<u32, Vec<GpuInstanceInfo>> = blocking(move || {
            ids.into_iter()
                .map(|g| {
                    b.gpu_instances(g)
                        .map(|v| (g, v))
                        .map_err(|source| PluginError::Backend {
                            op: format!("list GPU instances of GPU {g}"),
                            source,
                        })
                })
                .collect::<Result<_, _>>()
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "recovery",
            reason,
        })??;

        // Keep completed claims, refreshing ids from NVML; drop the rest.
        let mut kept = BTreeMap::new();
        for (uid, mut rec) in std::mem::take(&mut body.claims) {
            if rec.state != ClaimState::PrepareCompleted {
                report.rolled_back.push(uid.clone());
                if let Some(p) = &rec.cdi_spec {
                    cdi::remove(p)?;
                }
                continue;
            }
            if !self.refresh_from_nvml(&mut rec, &live) {
                report.missing_instances.push(uid.clone());
            }
            kept.insert(uid, rec);
        }
        if rebuild {
            for rec in self.adopt_from_api(&live).await? {
                report.adopted.push(rec.uid.clone());
                kept.insert(rec.uid.clone(), rec);
            }
        }
        report.kept = kept
            .keys()
            .filter(|k| !report.adopted.contains(k))
            .cloned()
            .collect();
        body.claims = kept;

        // MPS daemons: exactly the kept shares, before the sweep (a daemon's
        // server holds the instance it serves).
        self.reconcile_mps(&mut body, &live, &mut report).await?;

        // Orphan sweep on dynamic GPUs.
        let owned: BTreeSet<(u32, Placement, u32)> = body
            .claims
            .values()
            .flat_map(|c| c.devices.iter())
            .filter_map(|d| match &d.kind {
                PreparedKind::Mig {
                    placement,
                    profile_id,
                    ..
                } => Some((d.gpu_index, *placement, *profile_id)),
                PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => None,
            })
            .collect();
        let mut orphans: Vec<(u32, GpuInstanceInfo)> = Vec::new();
        for (g, instances) in &live {
            if self.gpus[g].policy != GpuPolicy::Dynamic {
                continue;
            }
            for i in instances {
                if !owned.contains(&(*g, i.placement, i.profile_id)) {
                    orphans.push((*g, i.clone()));
                }
            }
        }
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let o2 = orphans.clone();
        blocking(move || -> Result<(), ClaimError> {
            for (g, i) in &o2 {
                destroy_instance(&*b, retry, *g, i)?;
            }
            Ok(())
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "orphan sweep",
            reason,
        })?
        .map_err(|e| PluginError::Sweep {
            source: Box::new(e),
        })?;
        for (g, i) in &orphans {
            report.swept.push(format!("{g}/{}", i.id));
            if let Some(v) = live.get_mut(g) {
                v.retain(|x| x.id != i.id);
            }
        }

        // MIG mode back where the plugin enabled it and nothing is left.
        for gpu in self.gpus.values() {
            let g = gpu.info.index;
            let used = body
                .claims
                .values()
                .any(|c| c.devices.iter().any(|d| d.gpu_index == g));
            if !body.mig_enabled_by_plugin.contains(&gpu.info.uuid)
                || gpu.info.architecture.mig_mode_needs_reset()
                || used
                || live.get(&g).is_some_and(|v| !v.is_empty())
            {
                continue;
            }
            let b = self.backend.clone();
            match blocking(move || b.set_mig_mode(g, false)).await {
                Ok(Ok(_)) => {
                    body.mig_enabled_by_plugin.remove(&gpu.info.uuid);
                }
                Ok(Err(e)) => tracing::warn!(gpu = g, error = %e, "disabling MIG mode failed"),
                Err(e) => tracing::warn!(gpu = g, error = %e, "disabling MIG mode failed"),
            }
        }
        // Refresh cached MIG modes.
        for gpu in self.gpus.values() {
            if !gpu.info.mig_capable {
                continue;
            }
            let b = self.backend.clone();
            let g = gpu.info.index;
            if let Ok(Ok(m)) = blocking(move || b.mig_mode(g)).await {
                gpu.rt.lock().await.mig_current = m.current;
            }
        }

        // CDI specs: verify or rewrite kept ones, remove every other spec of ours.
        let mut wanted = BTreeSet::new();
        let nd = self.current_node_driver();
        for rec in body.claims.values_mut() {
            let path = cdi::claim_spec_path(&self.config.cdi_dir, &rec.uid);
            let spec = match Self::cdi_spec_for(rec, &nd, &self.config.driver.proc_driver_nvidia) {
                Ok(s) => s,
                Err(ClaimError::Cdi(e)) => return Err(e.into()),
                Err(e) => {
                    // The driver or a capability file is not found now: keep
                    // the spec written when the claim was prepared.
                    tracing::error!(claim.uid = %rec.uid, error = %e, "cannot rebuild the claim's CDI spec; keeping the one on disk");
                    rec.cdi_spec = Some(path.clone());
                    wanted.insert(path);
                    continue;
                }
            };
            if CdiSpec::read(&path).as_ref() != Some(&spec) {
                spec.write(&path, self.config.write_fault)?;
                report.cdi_rewritten.push(rec.uid.clone());
            }
            rec.cdi_spec = Some(path.clone());
            wanted.insert(path);
        }
        self.remove_stale_files(&wanted);

        checkpoint::write_boot_marker(&path, &self.boot_id).map_err(|source| PluginError::Io {
            what: "writing the checkpoint's boot marker",
            path: path.clone(),
            source,
        })?;
        // Always durable: it may replace a file of an earlier boot.
        let bytes: Arc<[u8]> = checkpoint::encode_body(&body, &path)?.into();
        checkpoint::store_bytes(&bytes, &path, true, self.config.write_fault)?;
        self.remember(bytes, &body, Source::Written);
        if let Some(m) = &self.config.metrics {
            m.inc_checkpoint_writes();
        }
        *self.state.lock().await = body;
        self.record_instances(self.gpus.keys().copied().collect::<Vec<_>>())
            .await;
        tracing::info!(?report, "recovery done");
        Ok(report)
    }

    async fn reconcile_mps(
        &self,
        body: &mut CheckpointBody,
        live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let Some(setup) = self.config.mps.clone() else {
            if let Some(d) = body
                .claims
                .values()
                .flat_map(|c| c.devices.iter())
                .find(|d| d.kind.mps().is_some())
            {
                tracing::error!(device = %d.device, "prepared MPS shares exist but the plugin runs without MPS; their daemons are not supervised and unprepare will fail until MPS is configured again");
            }
            return Ok(());
        };
        let pci = self.pci_map();
        let mut keep: BTreeMap<String, (carve_mps::MpsTarget, Vec<carve_mps::ClientSpec>)> =
            BTreeMap::new();
        for c in body.claims.values() {
            for d in &c.devices {
                let (Some(t), Some(cl)) = (
                    crate::mps::target_of(d, &pci),
                    crate::mps::client_of(&c.uid, d),
                ) else {
                    continue;
                };
                keep.entry(t.unit.clone())
                    .or_insert((t, Vec::new()))
                    .1
                    .push(cl);
            }
        }
        let uuids: BTreeMap<u32, String> = self
            .gpus
            .iter()
            .map(|(i, g)| (*i, g.info.uuid.clone()))
            .collect();
        let fallback = move |unit: &str| {
            unit.parse::<DeviceName>()
                .ok()
                .and_then(|n| uuids.get(&n.gpu()).cloned())
        };
        let s2 = setup.clone();
        let r = blocking(move || crate::mps::reconcile(&s2, &keep, &fallback))
            .await
            .map_err(|reason| PluginError::Task {
                what: "MPS recovery",
                reason,
            })?
            .map_err(|e| PluginError::MpsRecovery {
                source: Box::new(e),
            })?;
        for c in body.claims.values_mut() {
            for d in &mut c.devices {
                let Some(sid) = d.share_id.clone() else {
                    continue;
                };
                if let PreparedKind::Mps { share }
                | PreparedKind::Mig {
                    mps: Some(share), ..
                } = &mut d.kind
                    && let Some((edits, cgroup)) = r.shares.get(&(c.uid.clone(), sid))
                {
                    share.edits = Some(edits.clone());
                    share.cgroup.clone_from(cgroup);
                }
            }
        }
        report.mps_units = r.kept;
        report.mps_stopped = r.stopped;
        report.mps_failed = r.failed;

        // Compute modes carve set on devices no kept share uses: back to DEFAULT.
        let before = body.compute_mode_set_by_plugin.clone();
        prune_compute_modes(body);
        let stale: Vec<String> = before
            .difference(&body.compute_mode_set_by_plugin)
            .cloned()
            .collect();
        let mut targets = Vec::new();
        for u in &stale {
            if let Some(g) = self.gpus.values().find(|g| g.info.uuid == *u) {
                targets.push((u.clone(), carve_gpu::ComputeTarget::Gpu(g.info.index)));
            } else if let Some((g, gi, ci)) = live.iter().find_map(|(g, v)| {
                v.iter().find_map(|i| {
                    i.compute_instances
                        .iter()
                        .find(|c| c.mig_uuid.as_deref() == Some(u.as_str()))
                        .map(|c| (*g, i.id, c.id))
                })
            }) {
                targets.push((u.clone(), carve_gpu::ComputeTarget::Mig { gpu: g, gi, ci }));
            }
        }
        let b = self.backend.clone();
        let restored = blocking(move || {
            targets
                .into_iter()
                .filter_map(|(u, t)| {
                    match b.set_compute_mode(t, carve_gpu::ComputeMode::Default) {
                        Ok(()) => Some(u),
                        Err(e) => {
                            tracing::warn!(device = %u, error = %e, "restoring DEFAULT compute mode failed");
                            None
                        }
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "MPS recovery",
            reason,
        })?;
        report.compute_mode_restored = restored;
        self.record_mps(body);
        Ok(())
    }

    /// Keep the MPS daemons of prepared shares running: one that died is
    /// restarted with every share's limits re-applied. Returns the units that
    /// needed something, with what happened (or the error).
    pub async fn supervise_mps(&self) -> Vec<(String, Result<carve_mps::Ensure, ClaimError>)> {
        let Some(setup) = self.config.mps.clone() else {
            return Vec::new();
        };
        let pci = self.pci_map();
        let (units, gpus): (BTreeMap<String, carve_mps::MpsTarget>, BTreeSet<u32>) = {
            let st = self.state.lock().await;
            let mut units = BTreeMap::new();
            let mut gpus = BTreeSet::new();
            for c in st
                .claims
                .values()
                .filter(|c| c.state == ClaimState::PrepareCompleted)
            {
                for d in &c.devices {
                    if let Some(t) = crate::mps::target_of(d, &pci) {
                        gpus.insert(d.gpu_index);
                        units.entry(t.unit.clone()).or_insert(t);
                    }
                }
            }
            (units, gpus)
        };
        if units.is_empty() {
            return Vec::new();
        }
        let mut guards = Vec::new();
        for g in &gpus {
            if let Some(gpu) = self.gpus.get(g) {
                guards.push(gpu.rt.lock().await);
            }
        }
        let out = blocking(move || crate::mps::supervise(&setup, &units))
            .await
            .unwrap_or_else(|e| vec![("*".into(), Err(ClaimError::Task(e)))]);
        drop(guards);
        let out: Vec<_> = out
            .into_iter()
            // A fresh supervisor finds a live daemon "adopted": nothing was done.
            .filter(|(_, r)| {
                !matches!(
                    r,
                    Ok(carve_mps::Ensure::Running | carve_mps::Ensure::Adopted)
                )
            })
            .collect();
        for (unit, r) in &out {
            match r {
                Ok(e) => tracing::warn!(unit = %unit, outcome = ?e, "MPS daemon supervision"),
                Err(e) => tracing::error!(unit = %unit, error = %e, "MPS daemon supervision"),
            }
        }
        out
    }

    fn remove_stale_files(&self, wanted: &BTreeSet<PathBuf>) {
        if let Ok(rd) = std::fs::read_dir(&self.config.cdi_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours = name.starts_with("k8s.gpu.carve.dev-claim_")
                    || name.starts_with(".k8s.gpu.carve.dev-claim_");
                if ours && !wanted.contains(&e.path()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let cp = &self.config.checkpoint_path;
        if let (Some(dir), Some(name)) = (cp.parent(), cp.file_name()) {
            let prefix = format!(".{}.tmp-", name.to_string_lossy());
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&prefix) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
    }

    /// Update a completed claim's ids from NVML; false if an instance is gone.
    fn refresh_from_nvml(
        &self,
        rec: &mut ClaimRecord,
        live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
    ) -> bool {
        let mut all = true;
        for d in &mut rec.devices {
            if let PreparedKind::Mig {
                placement,
                profile_id,
                gi,
                ci,
                mig_uuid,
                ..
            } = &mut d.kind
            {
                let found = live.get(&d.gpu_index).and_then(|v| {
                    v.iter()
                        .find(|i| i.placement == *placement && i.profile_id == *profile_id)
                });
                match found.and_then(|i| i.compute_instances.first().map(|c| (i.id, c))) {
                    Some((gid, c)) => {
                        *gi = Some(gid);
                        *ci = Some(c.id);
                        if c.mig_uuid.is_some() {
                            mig_uuid.clone_from(&c.mig_uuid);
                        }
                    }
                    None => all = false,
                }
            }
        }
        all
    }

    /// After a corrupt checkpoint: claims allocated to this node whose MIG
    /// devices all match live instances become completed claims again.
    async fn adopt_from_api(
        &self,
        live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
    ) -> Result<Vec<ClaimRecord>, PluginError> {
        let api: Api<ReadClaim> = Api::all(self.client.clone());
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| PluginError::Kube {
                what: "list ResourceClaims".into(),
                source: Box::new(e),
            })?;
        let mut out = Vec::new();
        for ReadClaim(rc) in list.items {
            let Ok(planned) = self.plan(&rc) else {
                continue;
            };
            if planned.is_empty() {
                continue;
            }
            let mut rec = ClaimRecord {
                uid: rc.metadata.uid.clone().unwrap_or_default(),
                namespace: rc.metadata.namespace.clone().unwrap_or_default(),
                name: rc.metadata.name.clone().unwrap_or_default(),
                state: ClaimState::PrepareCompleted,
                cdi_spec: None,
                devices: planned.into_iter().map(|p| p.record).collect(),
            };
            if !self.refresh_from_nvml(&mut rec, live) {
                continue;
            }
            // Capability minors are not in NVML's instance list: read them.
            let b = self.backend.clone();
            let devs = rec.devices.clone();
            let Ok(Ok(devs)) = blocking(move || -> Result<Vec<DeviceRecord>, BackendError> {
                let mut devs = devs;
                for d in &mut devs {
                    if let PreparedKind::Mig {
                        gi: Some(g),
                        ci: Some(c),
                        cap_minors,
                        ..
                    } = &mut d.kind
                    {
                        *cap_minors = vec![
                            b.capability_minor(d.gpu_minor, *g, None)?,
                            b.capability_minor(d.gpu_minor, *g, Some(*c))?,
                        ];
                    }
                }
                Ok(devs)
            })
            .await
            else {
                continue;
            };
            rec.devices = devs;
            out.push(rec);
        }
        Ok(out)
    }
}

/// Validate the allocation and turn it into device plans (pure, no I/O).
fn plan_claim(
    config: &PluginConfig,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    rc: &ResourceClaim,
) -> Result<Vec<Planned>, ClaimError> {
    let alloc = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or(ClaimError::NotAllocated)?;
    let devices = alloc.devices.as_ref();
    let results = devices
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let configs = devices
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();
    let configs = parse_configs(&config.driver_name, configs)?;
    let mut planned: Vec<Planned> = Vec::new();
    for r in results.iter().filter(|r| r.driver == config.driver_name) {
        if r.pool != config.pool_name {
            return Err(ClaimError::OtherPool {
                device: r.device.clone(),
                pool: r.pool.clone(),
                ours: config.pool_name.clone(),
            });
        }
        let request = r
            .request
            .split('/')
            .next()
            .unwrap_or(&r.request)
            .to_string();
        if let Some(p) = planned
            .iter_mut()
            .find(|p| p.record.device == r.device && p.record.share_id == r.share_id)
        {
            if !p.record.requests.contains(&request) {
                p.record.requests.push(request);
            }
            continue;
        }
        let name: DeviceName = r.device.parse()?;
        let gpu_index = name.gpu();
        let gpu = gpus.get(&gpu_index).ok_or_else(|| ClaimError::NoSuchGpu {
            device: r.device.clone(),
            gpu: gpu_index,
        })?;
        let share = match &name {
            DeviceName::Mps { .. } | DeviceName::MigMps { .. } => {
                Some(plan_share(config, gpu, &name, r, &configs)?)
            }
            _ => None,
        };
        let kind = match &name {
            DeviceName::Gpu { .. } => PreparedKind::Gpu,
            DeviceName::Mig { .. } | DeviceName::MigMps { .. } => {
                if !gpu.info.mig_capable {
                    return Err(ClaimError::NotMigCapable {
                        device: r.device.clone(),
                        gpu: gpu_index,
                        uuid: gpu.info.uuid.clone(),
                    });
                }
                let (profile, start) = name.mig_placement().unwrap_or_default();
                let p = gpu
                    .profiles
                    .iter()
                    .find(|p| p.name == profile)
                    .ok_or_else(|| ClaimError::NoSuchProfile {
                        device: r.device.clone(),
                        gpu: gpu_index,
                        profile: profile.clone(),
                    })?;
                let placement = p
                    .placements
                    .iter()
                    .find(|pl| pl.start == start)
                    .copied()
                    .ok_or_else(|| ClaimError::BadPlacement {
                        device: r.device.clone(),
                        profile: profile.clone(),
                        start,
                        allowed: p.placements.iter().map(|pl| pl.start).collect(),
                    })?;
                PreparedKind::Mig {
                    profile,
                    profile_id: p.id,
                    placement,
                    created: gpu.policy == GpuPolicy::Dynamic,
                    gi: None,
                    ci: None,
                    mig_uuid: None,
                    cap_minors: Vec::new(),
                    mps: share,
                }
            }
            DeviceName::Mps { .. } => PreparedKind::Mps {
                share: share.ok_or_else(|| ClaimError::Task("MPS share not planned".into()))?,
            },
            DeviceName::TimeSlice { .. } => PreparedKind::TimeSlice,
        };
        if kind.mps().is_none() {
            // An MpsConfig naming this request is an error; a class-wide one is not for it.
            effective_mps(&configs, &r.request, &r.device, false)?;
        }
        let is_mig = matches!(kind, PreparedKind::Mig { .. });
        let caps = effective_capabilities(&configs, &r.request, &r.device, is_mig)?;
        planned.push(Planned {
            record: DeviceRecord {
                requests: vec![request],
                pool: r.pool.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone(),
                gpu_index,
                gpu_uuid: gpu.info.uuid.clone(),
                gpu_minor: gpu.info.minor,
                kind,
                capabilities_env: caps.map(|c| capabilities_env(&c)),
            },
        });
    }
    // Two devices of one claim must not overlap either.
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[..i] {
            if a.record.gpu_index != b.record.gpu_index || a.record.device == b.record.device {
                continue;
            }
            if conflicts(&a.record.kind, &b.record.kind) {
                return Err(ClaimError::Occupied {
                    device: a.record.device.clone(),
                    gpu: a.record.gpu_index,
                    placement: match &a.record.kind {
                        PreparedKind::Mig { placement, .. } => *placement,
                        PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => {
                            Placement::new(0, 0)
                        }
                    },
                    by: format!("device {} of the same claim", b.record.device),
                });
            }
        }
    }
    Ok(planned)
}

/// Forget compute modes carve set on units that no prepared share uses any
/// more (their daemons are gone; [`crate::mps::detach`] restored them).
fn prune_compute_modes(st: &mut CheckpointBody) {
    let used: BTreeSet<String> = st
        .claims
        .values()
        .flat_map(|c| c.devices.iter())
        .filter_map(|d| match &d.kind {
            PreparedKind::Mps { .. } => Some(d.gpu_uuid.clone()),
            PreparedKind::Mig {
                mps: Some(_),
                mig_uuid,
                ..
            } => mig_uuid.clone(),
            _ => None,
        })
        .collect();
    st.compute_mode_set_by_plugin.retain(|u| used.contains(u));
}

/// Validate an MPS allocation and turn its `consumedCapacity` into limits (pure).
fn plan_share(
    config: &PluginConfig,
    gpu: &Gpu,
    name: &DeviceName,
    r: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
    configs: &[crate::config::Applicable],
) -> Result<MpsShare, ClaimError> {
    let device = || r.device.clone();
    let setup = config
        .mps
        .as_ref()
        .ok_or_else(|| ClaimError::MpsDisabled { device: device() })?;
    let share_id = r.share_id.as_deref().ok_or_else(|| ClaimError::BadShare {
        device: device(),
        reason: "the allocation result has no shareID (the scheduler gives every share of a shareable device one; an API server with the DRAConsumableCapacity feature gate off drops shareID and consumedCapacity from the claim: enable it on kube-apiserver)".into(),
    })?;
    if share_id.is_empty()
        || share_id.len() > 64
        || !share_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(ClaimError::BadShare {
            device: device(),
            reason: format!("shareID {share_id:?} is not a UID"),
        });
    }
    let Some(consumed) = r.consumed_capacity.as_ref().filter(|c| !c.is_empty()) else {
        return Err(ClaimError::BadShare {
            device: device(),
            reason: "the allocation result has no consumedCapacity, so the share has no memory or SM limit (the scheduler records it with DRAConsumableCapacity enabled; an API server with that feature gate off drops it from the claim: enable it on kube-apiserver)".into(),
        });
    };
    let caps = setup.support.capabilities();
    let need = effective_mps(configs, &r.request, &r.device, true)?;
    if let Some(m) = need.memory_limit
        && caps.memory_limit < m
    {
        return Err(ClaimError::BadShare {
            device: device(),
            reason: format!(
                "opaque MpsConfig requires memoryLimit {}, this node enforces {}: {}",
                m.as_str(),
                caps.memory_limit.as_str(),
                carve_mps::detect::WHY_MEMORY_IS_CLIENT
            ),
        });
    }
    if let Some(c) = need.compute_limit
        && caps.compute_limit < c
    {
        return Err(ClaimError::BadShare {
            device: device(),
            reason: format!(
                "opaque MpsConfig requires computeLimit {}, this node enforces {}",
                c.as_str(),
                caps.compute_limit.as_str()
            ),
        });
    }
    let sharing_err = |source| ClaimError::Sharing {
        device: device(),
        source: Box::new(source),
    };
    let spec = match name.mig_placement() {
        None => MpsDeviceSpec::whole(&gpu.physical, caps),
        Some((profile, start)) => MpsDeviceSpec::mig(&gpu.physical, &profile, start, caps),
    }
    .map_err(sharing_err)?;
    let limits = translate(consumed, &spec).map_err(sharing_err)?;
    Ok(MpsShare {
        unit: r.device.clone(),
        limits,
        cgroup: None,
        edits: None,
    })
}

/// Whether two devices on the same GPU cannot be prepared at the same time:
/// anything excludes a whole GPU; time-slice shares go together, MPS shares of
/// one unit go together; MIG devices clash when they overlap, unless both are
/// MPS shares of the same instance.
fn conflicts(a: &PreparedKind, b: &PreparedKind) -> bool {
    match (a, b) {
        (PreparedKind::TimeSlice, PreparedKind::TimeSlice) => false,
        (PreparedKind::Mps { share: x }, PreparedKind::Mps { share: y }) => x.unit != y.unit,
        (
            PreparedKind::Mig {
                placement: x,
                mps: sx,
                ..
            },
            PreparedKind::Mig {
                placement: y,
                mps: sy,
                ..
            },
        ) => {
            let same_unit = matches!((sx, sy), (Some(p), Some(q)) if p.unit == q.unit);
            x.overlaps(*y) && !same_unit
        }
        _ => true,
    }
}

/// How a device holds its GPU, for error messages.
fn holds(kind: &PreparedKind) -> &'static str {
    match kind {
        PreparedKind::Gpu => "as a whole GPU",
        PreparedKind::TimeSlice => "as a time-sliced GPU",
        PreparedKind::Mps { .. } => "through MPS",
        PreparedKind::Mig { .. } => "using its MIG devices",
    }
}

/// Instances and current MIG mode of GPUs, by index.
type GpuReads = BTreeMap<u32, (Vec<GpuInstanceInfo>, bool)>;

/// Compute modes of GPUs, by index.
type Modes = BTreeMap<u32, carve_gpu::ComputeMode>;

/// What prepare read before deciding: the GPUs, and the compute modes of the
/// GPUs that MPS shares are on.
type Snapshot = (GpuReads, Modes);

/// The hardware step's outcome (GPUs whose MIG mode it turned on, and off)
/// and the records it filled in.
type Made = (Result<(Vec<u32>, Vec<u32>), ClaimError>, Vec<DeviceRecord>);

/// Read the instances and the MIG mode of `ids`. Blocking.
fn read_gpus(b: &dyn GpuBackend, ids: &[u32]) -> Result<GpuReads, ClaimError> {
    ids.iter()
        .map(|&g| {
            let v = b
                .gpu_instances(g)
                .map_err(backend_err(format!("list GPU instances of GPU {g}")))?;
            let m = b
                .mig_mode(g)
                .map_err(backend_err(format!("read MIG mode of GPU {g}")))?;
            Ok((g, (v, m.current)))
        })
        .collect()
}

/// How prepare's one-hop path ended.
enum Fast {
    /// Instances made (or `make_devices`' error, after its own rollback).
    Done(Result<(Vec<u32>, Vec<u32>), ClaimError>, Vec<DeviceRecord>),
    /// A GPU is out of MIG mode: the general path decides, with these reads.
    Slow(GpuReads),
    /// Refused before anything was made (a read failed, a placement is taken).
    Refused(ClaimError),
}

/// The devices `records` against NVML truth (`live`, the GPUs' instances):
/// a whole GPU must have no instance, a dynamic MIG placement no instance
/// overlapping it (except the instance of an MPS unit that `shared` says
/// another claim already shares), a static MIG device its instance.
fn check_live<'r>(
    records: impl IntoIterator<Item = &'r DeviceRecord>,
    live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    shared: impl Fn(&DeviceRecord) -> bool,
) -> Result<(), ClaimError> {
    for d in records {
        let g = d.gpu_index;
        let gpu = &gpus[&g];
        let instances = live.get(&g).map(Vec::as_slice).unwrap_or_default();
        match &d.kind {
            PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => {
                if !instances.is_empty() {
                    return Err(ClaimError::GpuHasInstances {
                        device: d.device.clone(),
                        gpu: g,
                        instances: instances
                            .iter()
                            .map(|i| describe(i, &gpu.profiles))
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            }
            PreparedKind::Mig {
                profile,
                profile_id,
                placement,
                mps,
                ..
            } => match gpu.policy {
                GpuPolicy::Dynamic => {
                    let shared = mps.is_some() && shared(d);
                    if let Some(i) = instances.iter().find(|i| {
                        i.placement.overlaps(*placement)
                            && !(shared && i.placement == *placement && i.profile_id == *profile_id)
                    }) {
                        return Err(ClaimError::Occupied {
                            device: d.device.clone(),
                            gpu: g,
                            placement: *placement,
                            by: format!("{} that carve does not know", describe(i, &gpu.profiles)),
                        });
                    }
                }
                GpuPolicy::Static => {
                    let exists = instances.iter().any(|i| {
                        i.placement == *placement
                            && i.profile_id == *profile_id
                            && !i.compute_instances.is_empty()
                    });
                    if !exists {
                        return Err(ClaimError::StaticMissing {
                            device: d.device.clone(),
                            gpu: g,
                            profile: profile.clone(),
                            placement: *placement,
                        });
                    }
                }
            },
        }
    }
    Ok(())
}

/// Enable MIG where needed, then create or find each device's instances.
/// Returns the GPUs whose MIG mode is now on. On error destroys what it
/// created. Blocking.
fn make_devices(
    b: &dyn GpuBackend,
    retry: Retry,
    (enable_mig, disable_mig): (&[u32], &[u32]),
    records: &mut [DeviceRecord],
    live: &BTreeMap<u32, Vec<GpuInstanceInfo>>,
    shared: &BTreeMap<String, DeviceRecord>,
) -> Result<(Vec<u32>, Vec<u32>), ClaimError> {
    let mut disabled = Vec::new();
    for g in disable_mig {
        let m = b
            .set_mig_mode(*g, false)
            .map_err(backend_err(format!("disable MIG mode on GPU {g}")))?;
        if m.current {
            return Err(ClaimError::WholeInMigMode {
                device: format!("gpu-{g}"),
                gpu: *g,
                why: "disabling MIG mode is pending a GPU reset",
            });
        }
        disabled.push(*g);
    }
    let mut enabled = Vec::new();
    for g in enable_mig {
        let m = b
            .set_mig_mode(*g, true)
            .map_err(backend_err(format!("enable MIG mode on GPU {g}")))?;
        if !m.current {
            return Err(ClaimError::MigPending { gpu: *g });
        }
        enabled.push(*g);
    }
    // (gpu, gi, ci) made so far, for rollback.
    let mut made: Vec<(u32, u32, Option<u32>)> = Vec::new();
    let res = (|| {
        for d in records.iter_mut() {
            let g = d.gpu_index;
            let minor = d.gpu_minor;
            let device = d.device.clone();
            let PreparedKind::Mig {
                profile,
                profile_id,
                placement,
                created: create,
                gi,
                ci,
                mig_uuid,
                cap_minors,
                mps,
            } = &mut d.kind
            else {
                continue;
            };
            // An MPS share of an instance other claims already share: use it.
            if let Some(PreparedKind::Mig {
                gi: Some(sg),
                ci: Some(sc),
                mig_uuid: Some(su),
                cap_minors: sm,
                ..
            }) = mps
                .as_ref()
                .and_then(|s| shared.get(&s.unit))
                .map(|r| &r.kind)
            {
                *gi = Some(*sg);
                *ci = Some(*sc);
                *mig_uuid = Some(su.clone());
                cap_minors.clone_from(sm);
                continue;
            }
            let (gid, cid, uuid) = if *create {
                let info =
                    b.create_gpu_instance(g, *profile_id, *placement)
                        .map_err(backend_err(format!(
                            "create GPU instance {profile} at {placement} on GPU {g}"
                        )))?;
                made.push((g, info.id, None));
                let c = b
                    .create_compute_instance(g, info.id)
                    .map_err(backend_err(format!(
                        "create compute instance in GPU {g} GI {}",
                        info.id
                    )))?;
                if let Some(last) = made.last_mut() {
                    last.2 = Some(c.id);
                }
                (info.id, c.id, c.mig_uuid)
            } else {
                let (gid, c) = live
                    .get(&g)
                    .and_then(|v| {
                        v.iter()
                            .find(|i| i.placement == *placement && i.profile_id == *profile_id)
                    })
                    .and_then(|i| i.compute_instances.first().map(|c| (i.id, c.clone())))
                    .ok_or_else(|| ClaimError::StaticMissing {
                        device: device.clone(),
                        gpu: g,
                        profile: profile.clone(),
                        placement: *placement,
                    })?;
                (gid, c.id, c.mig_uuid)
            };
            *gi = Some(gid);
            *ci = Some(cid);
            let Some(uuid) = uuid else {
                return Err(ClaimError::Backend {
                    op: format!("read MIG UUID of GPU {g} GI {gid} CI {cid}"),
                    source: BackendError::NoSuch {
                        what: format!("MIG UUID for GPU {g} GI {gid} CI {cid}"),
                    },
                });
            };
            *mig_uuid = Some(uuid);
            *cap_minors = vec![
                b.capability_minor(minor, gid, None)
                    .map_err(backend_err(format!("capability of GPU {g} GI {gid}")))?,
                b.capability_minor(minor, gid, Some(cid))
                    .map_err(backend_err(format!(
                        "capability of GPU {g} GI {gid} CI {cid}"
                    )))?,
            ];
        }
        Ok(())
    })();
    match res {
        Ok(()) => Ok((enabled, disabled)),
        Err(e) => {
            for (g, gi, ci) in made.iter().rev() {
                let r = ci
                    .map_or(Ok(()), |c| {
                        with_retry(retry, "rollback: destroy compute instance", || {
                            b.destroy_compute_instance(*g, *gi, c)
                        })
                    })
                    .and_then(|()| {
                        with_retry(retry, "rollback: destroy GPU instance", || {
                            b.destroy_gpu_instance(*g, *gi)
                        })
                    });
                if let Err(re) = r {
                    tracing::error!(gpu = g, gi, error = %re, "rollback after failed prepare");
                }
            }
            Err(e)
        }
    }
}

/// Destroy the instances the plugin created for these devices (CI then GI),
/// verifying by placement that the id still names the same instance.
/// Blocking.
fn destroy_devices(
    b: &dyn GpuBackend,
    retry: Retry,
    devs: &[DeviceRecord],
    keep: &BTreeSet<String>,
) -> Result<(), ClaimError> {
    let mut cache: BTreeMap<u32, Vec<GpuInstanceInfo>> = BTreeMap::new();
    for d in devs {
        let PreparedKind::Mig {
            placement,
            profile_id,
            created: true,
            gi,
            ci,
            mps,
            ..
        } = &d.kind
        else {
            continue;
        };
        if mps.as_ref().is_some_and(|s| keep.contains(&s.unit)) {
            // Other claims still share this instance through MPS.
            continue;
        }
        let g = d.gpu_index;
        let instances = match cache.entry(g) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(
                b.gpu_instances(g)
                    .map_err(backend_err(format!("list GPU instances of GPU {g}")))?,
            ),
        };
        let found = instances
            .iter()
            .find(|i| Some(i.id) == *gi && i.placement == *placement)
            .or_else(|| {
                instances
                    .iter()
                    .find(|i| i.placement == *placement && i.profile_id == *profile_id)
            });
        let Some(i) = found else { continue };
        let mut i = i.clone();
        if i.compute_instances.is_empty()
            && let Some(c) = ci
        {
            // Listed before the CI existed; try the recorded one too.
            i.compute_instances.push(carve_gpu::ComputeInstanceInfo {
                id: *c,
                profile_id: 0,
                mig_uuid: None,
            });
        }
        destroy_instance(b, retry, g, &i)?;
    }
    Ok(())
}

/// Dynamic GPUs of these models (`GpuModel` names) as the driver holds them,
/// without NVML: for the plan tests and the fuzz targets.
#[cfg(any(test, feature = "fuzzing"))]
fn simulated_gpus(models: &[&str]) -> BTreeMap<u32, Arc<Gpu>> {
    models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let spec = carve_model::GpuModel::find(m)
                .expect("a known GPU model")
                .spec();
            let i = i as u32;
            let info = GpuInfo {
                index: i,
                minor: i,
                uuid: format!("GPU-{i}"),
                name: spec.product_name.clone(),
                architecture: spec.architecture,
                cuda_compute_capability: spec.cuda_compute_capability,
                driver_version: "580.65.06".into(),
                pci_bus_id: String::new(),
                memory_mib: spec.memory_mib,
                multiprocessors: spec.multiprocessors,
                mig_capable: spec.mig_capable,
                mig_mode: spec.mig_capable.then_some(carve_gpu::MigMode {
                    current: false,
                    pending: false,
                }),
            };
            (
                i,
                Arc::new(Gpu {
                    physical: carve_model::PhysicalGpu {
                        index: info.index,
                        minor: info.minor,
                        uuid: info.uuid.clone(),
                        pci_bus_id: None,
                        pcie_root: None,
                        driver_version: "580.65.6".into(),
                        spec: spec.clone(),
                    },
                    info,
                    profiles: spec.profiles,
                    policy: GpuPolicy::Dynamic,
                    rt: tokio::sync::Mutex::new(GpuRuntime { mig_current: false }),
                }),
            )
        })
        .collect()
}

/// Fuzzing entry ([`crate::fuzzing`]): plan `rc` for node `node-a` with an
/// H100, an A100 and an L4 (the validation every claim from the API server
/// goes through before anything is made). Returns the number of devices.
#[cfg(feature = "fuzzing")]
pub(crate) fn plan_on_simulated_node(rc: &ResourceClaim) -> Result<usize, ClaimError> {
    static GPUS: std::sync::OnceLock<BTreeMap<u32, Arc<Gpu>>> = std::sync::OnceLock::new();
    let gpus = GPUS.get_or_init(|| simulated_gpus(&["h100-80gb", "a100-40gb", "l4-24gb"]));
    plan_claim(&PluginConfig::new("node-a"), gpus, rc).map(|p| p.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(models: &[&str]) -> BTreeMap<u32, Arc<Gpu>> {
        simulated_gpus(models)
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    fn res(req: &str, pool: &str, device: &str) -> serde_json::Value {
        serde_json::json!({"request": req, "driver": "gpu.carve.dev", "pool": pool, "device": device})
    }

    fn cfg() -> PluginConfig {
        PluginConfig::new("node-a")
    }

    #[test]
    fn plans_mig_and_whole_gpu_devices() {
        let g = gpus(&["h100-80gb", "l4-24gb"]);
        let rc = claim(
            serde_json::json!([
                res("a/small", "node-a", "gpu-0-mig-1g10gb-3"),
                res("b", "node-a", "gpu-1"),
                {"request": "x", "driver": "other.dev", "pool": "p", "device": "whatever"}
            ]),
            serde_json::json!([]),
        );
        let p = plan_claim(&cfg(), &g, &rc).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].record.requests, ["a"]);
        match &p[0].record.kind {
            PreparedKind::Mig {
                profile,
                placement,
                created,
                gi,
                ..
            } => {
                assert_eq!(profile, "1g.10gb");
                assert_eq!(*placement, Placement::new(3, 1));
                assert!(*created);
                assert!(gi.is_none());
            }
            _ => panic!("expected MIG"),
        }
        assert_eq!(p[1].record.kind, PreparedKind::Gpu);
        assert_eq!(p[1].record.gpu_uuid, "GPU-1");
    }

    #[test]
    fn bad_allocations_name_the_problem() {
        let g = gpus(&["a100-40gb", "l4-24gb"]);
        let cases = [
            (
                res("r", "node-b", "gpu-0"),
                "allocated from pool \"node-b\"",
            ),
            (
                res("r", "node-a", "gpu-0-mig-bogus-1"),
                "\"gpu-0-mig-bogus-1\" is not a carve device name",
            ),
            (
                res("r", "node-a", "gpu-7-mig-1g5gb-0"),
                "this node has no GPU 7",
            ),
            (
                res("r", "node-a", "gpu-0-mig-1g80gb-0"),
                "GPU 0 has no MIG profile 1g.80gb",
            ),
            (
                res("r", "node-a", "gpu-0-mig-3g20gb-1"),
                "cannot be placed at slice 1",
            ),
            (
                res("r", "node-a", "gpu-1-mig-1g5gb-0"),
                "GPU 1 (GPU-1) is not MIG-capable",
            ),
            (
                res("r", "node-a", "gpu-0-mps"),
                "MPS is not enabled on this node",
            ),
        ];
        for (r, want) in cases {
            let e = plan_claim(
                &cfg(),
                &g,
                &claim(serde_json::json!([r]), serde_json::json!([])),
            )
            .unwrap_err();
            assert!(e.to_string().contains(want), "{e} / {want}");
        }
        let unalloc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "spec": {}
        }))
        .unwrap();
        assert!(matches!(
            plan_claim(&cfg(), &g, &unalloc),
            Err(ClaimError::NotAllocated)
        ));
    }

    #[test]
    fn overlapping_devices_in_one_claim_are_rejected() {
        let g = gpus(&["a100-40gb"]);
        let rc = claim(
            serde_json::json!([
                res("a", "node-a", "gpu-0-mig-4g20gb-0"),
                res("b", "node-a", "gpu-0-mig-1g5gb-3")
            ]),
            serde_json::json!([]),
        );
        let e = plan_claim(&cfg(), &g, &rc).unwrap_err().to_string();
        assert!(
            e.contains("occupied by device gpu-0-mig-4g20gb-0 of the same claim"),
            "{e}"
        );
    }

    #[test]
    fn opaque_config_reaches_the_record() {
        let g = gpus(&["a100-40gb"]);
        let rc = claim(
            serde_json::json!([res("a", "node-a", "gpu-0-mig-1g5gb-0")]),
            serde_json::json!([{"source": "FromClaim", "opaque": {"driver": "gpu.carve.dev",
                "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "MigConfig", "driverCapabilities": ["compute", "utility"]}}}]),
        );
        let p = plan_claim(&cfg(), &g, &rc).unwrap();
        assert_eq!(
            p[0].record.capabilities_env.as_deref(),
            Some("NVIDIA_DRIVER_CAPABILITIES=compute,utility")
        );
    }

    #[test]
    fn cdi_spec_from_record() {
        let rec = ClaimRecord {
            uid: "u-1".into(),
            namespace: "ns".into(),
            name: "c".into(),
            state: ClaimState::PrepareCompleted,
            cdi_spec: None,
            devices: vec![DeviceRecord {
                requests: vec!["a".into()],
                pool: "node-a".into(),
                device: "gpu-2-mig-1g10gb-3".into(),
                share_id: None,
                gpu_index: 2,
                gpu_uuid: "GPU-2".into(),
                gpu_minor: 2,
                kind: PreparedKind::Mig {
                    profile: "1g.10gb".into(),
                    profile_id: 19,
                    placement: Placement::new(3, 1),
                    created: true,
                    gi: Some(7),
                    ci: Some(0),
                    mig_uuid: Some("MIG-7".into()),
                    cap_minors: vec![66, 67],
                    mps: None,
                },
                capabilities_env: None,
            }],
        };
        let d = tempfile::tempdir().unwrap();
        let fake =
            nvidia_ml_sim::driver_root::write_fake_driver(d.path(), "580.65.06", &[]).unwrap();
        let access = d.path().join("proc/capabilities/gpu2/mig/gi7");
        std::fs::create_dir_all(access.join("ci0")).unwrap();
        std::fs::write(
            access.join("access"),
            "DeviceFileMinor: 66\nDeviceFileMode: 292\n",
        )
        .unwrap();
        std::fs::write(
            access.join("ci0/access"),
            "DeviceFileMinor: 67\nDeviceFileMode: 256\n",
        )
        .unwrap();
        let cfg = crate::DriverRootConfig {
            container_root: fake.root.clone(),
            proc_devices: fake.devices_file.clone(),
            ..crate::DriverRootConfig::default()
        };
        let nd = NodeDriver::discover(&cfg, Some("580.65.06"));
        let s = Driver::cdi_spec_for(&rec, &nd, &d.path().join("proc")).unwrap();
        assert_eq!(s.devices[0].name, "u-1-gpu-2-mig-1g10gb-3");
        let e = &s.devices[0].container_edits;
        assert!(e.env.is_empty(), "no visible-device variables: {:?}", e.env);
        let caps: Vec<_> = e.device_nodes[1..]
            .iter()
            .map(|n| {
                (
                    n.path.as_str(),
                    n.dev_type.as_deref(),
                    n.major,
                    n.minor,
                    n.file_mode,
                )
            })
            .collect();
        let major = Some(i64::from(nvidia_ml_sim::driver_root::CAPS_MAJOR));
        assert_eq!(
            caps,
            [
                (
                    "/dev/nvidia-caps/nvidia-cap66",
                    Some("c"),
                    major,
                    Some(66),
                    Some(0o444)
                ),
                (
                    "/dev/nvidia-caps/nvidia-cap67",
                    Some("c"),
                    major,
                    Some(67),
                    Some(0o400)
                ),
            ]
        );
        assert!(
            s.container_edits
                .as_ref()
                .unwrap()
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
        );
        let d = Driver::prepared_devices(&rec);
        assert_eq!(
            d[0].cdi_device_ids,
            ["k8s.gpu.carve.dev/claim=u-1-gpu-2-mig-1g10gb-3"]
        );
    }
}
