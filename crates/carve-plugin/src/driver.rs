//! The driver: prepare and unprepare claims against the GPUs, keep the
//! checkpoint and CDI specs, and converge from NVML truth at start. One
//! file per part of a claim's life:
//!
//! - [`plan`]: a claim's allocation becomes device records (pure);
//! - [`prepare`]: one path that makes a claim's devices;
//! - [`unprepare`]: takes them apart again;
//! - [`recovery`]: convergence at start, and garbage collection;
//! - [`state`]: the checkpointed state and the host lock;
//! - [`status`]: the claim-status writer;
//! - [`mig`]: MIG instances read, checked, made and destroyed;
//! - [`mps_shares`]: MPS attachment, reconciliation and supervision;
//! - [`cdi_spec`]: what a container gets (driver files, CDI spec);
//! - [`error`]: [`ClaimError`], what the kubelet is told per claim.
//!
//! Locking: one async mutex per GPU serialises NVML work on that GPU (taken in
//! ascending GPU order); the checkpoint mutex is taken inside GPU locks and is
//! never held across NVML calls; one mutex per claim UID makes repeated calls
//! for the same claim idempotent. NVML calls run in `spawn_blocking`.

mod cdi_spec;
mod error;
mod mig;
mod mps_shares;
mod plan;
mod prepare;
mod recovery;
mod state;
mod status;
mod unprepare;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use carve_gpu::{GpuBackend, GpuInfo};
use carve_model::MigProfile;

pub use error::ClaimError;
#[cfg(feature = "fuzzing")]
pub(crate) use plan::plan_on_simulated_node;
pub use recovery::RecoveryReport;

use crate::checkpoint::CheckpointBody;
use crate::claim::ClaimRef;
use crate::config::{GpuPolicy, PluginConfig};
use crate::driver_root::NodeDriver;
use crate::error::PluginError;
use cdi_spec::log_driver;
use state::DiskCopy;

/// A GPU as the driver holds it: read once at start.
#[derive(Debug)]
struct Gpu {
    info: GpuInfo,
    profiles: Vec<MigProfile>,
    policy: GpuPolicy,
    /// The GPU as the slice builder sees it (for MPS share ranges).
    physical: carve_model::PhysicalGpu,
    /// Serialises NVML work on this GPU.
    lock: tokio::sync::Mutex<()>,
}

impl Gpu {
    fn new(info: GpuInfo, profiles: Vec<MigProfile>, policy: GpuPolicy) -> Self {
        let physical = info.physical(info.spec(profiles.clone()));
        Self {
            info,
            profiles,
            policy,
            physical,
            lock: tokio::sync::Mutex::default(),
        }
    }
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

/// What the kubelet asks of a claim, as [`Driver::observe`] logs and
/// measures it.
#[derive(Debug, Clone, Copy)]
enum ClaimOp {
    Prepare,
    Unprepare,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    // The caller's span (the claim a prepare or unprepare is of) goes along,
    // so that what NVML and MPS log on the blocking thread names the claim.
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| e.to_string())
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
        let inventory = blocking(move || read_inventory(&*b))
            .await
            .map_err(|reason| PluginError::Task {
                what: "GPU inventory",
                reason,
            })??;
        let gpus = with_policies(inventory, &config);
        let boot_id = read_boot_id(&config)?;
        let node_driver = discover_node_driver(&config, &gpus);
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

    /// The outcome `r` of `op` on claim `c`, as the kubelet asked for it
    /// at `started`: a failure logged, the call's duration and outcome
    /// recorded in the metrics.
    fn observe<T>(
        &self,
        op: ClaimOp,
        c: &ClaimRef,
        r: &Result<T, ClaimError>,
        started: std::time::Instant,
    ) {
        if let Err(e) = r {
            match op {
                ClaimOp::Prepare => {
                    tracing::warn!(claim.uid = %c.uid, claim = %c, error = %e, "prepare failed");
                }
                ClaimOp::Unprepare => {
                    tracing::warn!(claim.uid = %c.uid, claim = %c, error = %e, "unprepare failed");
                }
            }
        }
        if let Some(m) = &self.config.metrics {
            let outcome = r
                .as_ref()
                .map(|_| ())
                .map_err(crate::metrics::failure_reason);
            match op {
                ClaimOp::Prepare => m.observe_prepare(started.elapsed(), outcome),
                ClaimOp::Unprepare => m.observe_unprepare(started.elapsed(), outcome),
            }
        }
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

    /// Lock the GPUs `ids` (in ascending order) for NVML work.
    async fn lock_gpus(&self, ids: &BTreeSet<u32>) -> Vec<tokio::sync::MutexGuard<'_, ()>> {
        let mut guards = Vec::new();
        for id in ids {
            if let Some(g) = self.gpus.get(id) {
                guards.push(g.lock.lock().await);
            }
        }
        guards
    }

    /// PCI bus ids by GPU index.
    fn pci_map(&self) -> BTreeMap<u32, String> {
        self.gpus
            .iter()
            .map(|(i, g)| (*i, g.info.pci_bus_id.clone()))
            .collect()
    }
}

/// The GPUs and the MIG profiles of each, from NVML. Blocking.
///
/// A GPU whose MIG data cannot be read (an NVML without the MIG calls,
/// inconsistent profiles) is served whole: one error for it, no MIG
/// devices, the other GPUs unaffected.
fn read_inventory(b: &dyn GpuBackend) -> Result<Vec<(GpuInfo, Vec<MigProfile>)>, PluginError> {
    let gpus = b.gpus().map_err(|source| PluginError::Backend {
        op: "list GPUs".into(),
        source,
    })?;
    let mut out = Vec::new();
    for g in gpus {
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
}

/// The GPUs by index, each with its MIG policy from `config` (its own, or
/// the default).
fn with_policies(
    inventory: Vec<(GpuInfo, Vec<MigProfile>)>,
    config: &PluginConfig,
) -> BTreeMap<u32, Arc<Gpu>> {
    inventory
        .into_iter()
        .map(|(info, profiles)| {
            let policy = config
                .gpu_policy
                .get(&info.index)
                .copied()
                .unwrap_or(config.default_policy);
            (info.index, Arc::new(Gpu::new(info, profiles, policy)))
        })
        .collect()
}

/// This boot's id, from [`PluginConfig::boot_id_path`].
fn read_boot_id(config: &PluginConfig) -> Result<String, PluginError> {
    let id = std::fs::read_to_string(&config.boot_id_path).map_err(|source| PluginError::Io {
        what: "reading boot id",
        path: config.boot_id_path.clone(),
        source,
    })?;
    Ok(id.trim().to_string())
}

/// The NVIDIA driver's files on this node, for the version the GPUs report;
/// what it could not find logged (see [`log_driver`]).
fn discover_node_driver(config: &PluginConfig, gpus: &BTreeMap<u32, Arc<Gpu>>) -> NodeDriver {
    let version = gpus.values().next().map(|g| g.info.driver_version.clone());
    let needs_caps = gpus.values().any(|g| g.info.mig_capable);
    let node_driver = NodeDriver::discover(&config.driver, version.as_deref());
    log_driver(&node_driver, needs_caps, None);
    node_driver
}
