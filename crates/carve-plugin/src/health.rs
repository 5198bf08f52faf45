//! GPU health in the plugin: a [`HealthMonitor`] that watches NVML health events
//! (through [`GpuEvents`]) and the GPUs themselves (lost or present, live MIG
//! instances through [`GpuBackend`]), folds them into
//! [`carve_model::health::HealthState`], and publishes a [`HealthSnapshot`] on
//! every change (the binary puts its taints on the published ResourceSlices
//! through `carve_kube::desired::with_taints`, which validates them for the
//! API server's version). The `v1alpha1.DRAResourceHealth` stream on `dra.sock` is
//! served from a [`HealthHandle`] by [`serve_with`], through the
//! [`dra_kubeletplugin`] kit's health service.
//!
//! Not here: classifying events (`carve_model::health`), publishing slices
//! (the caller republishes with the snapshot's taints).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_gpu::{GpuBackend, GpuEvents, live_instances};
use carve_model::DeviceName;
use carve_model::MigProfile;
use carve_model::health::{DeviceHealth, HealthPolicy, HealthState, LiveInstance};
use k8s_openapi::api::resource::v1::DeviceTaint;
use tokio::sync::watch;

pub use crate::server::{ServeOptions, serve_with};

/// Tunables of a [`HealthMonitor`].
#[derive(Clone, Debug)]
pub struct HealthOptions {
    /// Longest wait for NVML events per loop; also how often GPUs are probed
    /// (lost, reset, live instances) and quiet periods are checked.
    pub poll: Duration,
    /// How events become conditions.
    pub policy: HealthPolicy,
}

impl Default for HealthOptions {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(5),
            policy: HealthPolicy::default(),
        }
    }
}

/// What the node's devices look like health-wise, as published on each change.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthSnapshot {
    /// Increases by one with every published change (0 = the first snapshot).
    pub generation: u64,
    /// Taints per device name; devices without taints are absent.
    pub taints: BTreeMap<String, Vec<DeviceTaint>>,
    /// Health of every device the monitor was given, in that order.
    pub devices: Vec<DeviceHealth>,
}

/// A health-policy or slice problem.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// [`HealthOptions::poll`] is zero: the loop would spin on NVML.
    #[error("health poll interval must be positive, got {poll:?}")]
    ZeroPoll {
        /// The configured interval.
        poll: Duration,
    },
    /// The monitor's loop thread failed.
    #[error("health monitor task: {reason}")]
    Task {
        /// The join error.
        reason: String,
    },
}

/// Starts the health loop; see [`HealthMonitor::start`].
#[derive(Debug)]
pub struct HealthMonitor;

struct Shared {
    stop: AtomicBool,
    /// Unix seconds of the end of the latest loop iteration.
    last_check: AtomicU64,
}

/// Stops the loop when the last [`HealthHandle`] is dropped.
struct Guard {
    shared: Arc<Shared>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("stop", &self.shared.stop.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

/// A running [`HealthMonitor`]: subscribe to its snapshots, stop it.
/// Clones share one loop; it stops on [`HealthHandle::stop`] or when the last
/// clone is dropped (within one poll interval).
#[derive(Clone, Debug)]
pub struct HealthHandle {
    rx: watch::Receiver<HealthSnapshot>,
    guard: Arc<Guard>,
}

impl HealthHandle {
    /// Snapshots: the current one at once, then each change. The sender closes
    /// when the loop stops.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<HealthSnapshot> {
        self.rx.clone()
    }

    /// The current snapshot.
    #[must_use]
    pub fn snapshot(&self) -> HealthSnapshot {
        self.rx.borrow().clone()
    }

    /// When the loop last finished looking at the GPUs (it may be earlier than
    /// the snapshot's change times when the loop is stuck in NVML).
    #[must_use]
    pub fn last_check(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.guard.shared.last_check.load(Ordering::SeqCst))
    }

    /// Stop the loop and wait until it has ended (at most one poll interval,
    /// the longest NVML wait). Later calls return at once.
    ///
    /// # Errors
    /// [`HealthError::Task`] when the loop panicked.
    pub async fn stop(&self) -> Result<(), HealthError> {
        self.guard.shared.stop.store(true, Ordering::SeqCst);
        let task = self
            .guard
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match task {
            Some(t) => t.await.map_err(|e| HealthError::Task {
                reason: e.to_string(),
            }),
            None => Ok(()),
        }
    }
}

/// The loop's state, owned by the blocking thread.
struct Looper {
    backend: Arc<dyn GpuBackend>,
    events: Arc<dyn GpuEvents>,
    devices: Vec<DeviceName>,
    gpus: BTreeSet<u32>,
    state: HealthState,
    profiles: BTreeMap<u32, Vec<MigProfile>>,
    live: BTreeMap<u32, Vec<LiveInstance>>,
    lost: BTreeSet<u32>,
    poll: Duration,
    generation: u64,
}

impl Looper {
    /// Round after round until `shared` says stop: the time of each check
    /// kept, a changed state published on `tx` as the next generation.
    /// Blocking.
    fn run(mut self, shared: &Shared, tx: &watch::Sender<HealthSnapshot>) {
        while !shared.stop.load(Ordering::SeqCst) {
            let changed = self.round(self.poll);
            let now = SystemTime::now();
            shared.last_check.store(unix_secs(now), Ordering::SeqCst);
            if shared.stop.load(Ordering::SeqCst) {
                break;
            }
            if changed {
                self.generation += 1;
                let snap = self.snapshot(now);
                tracing::info!(
                    generation = snap.generation,
                    tainted = snap.taints.len(),
                    "GPU health changed"
                );
                tx.send_replace(snap);
            }
        }
        tracing::info!("health monitor stopped");
    }

    /// One round: wait for events, probe every GPU, fold, expire. Returns
    /// whether health or taints changed.
    fn round(&mut self, wait: Duration) -> bool {
        let events = match self.events.wait_events(wait) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "waiting for GPU health events");
                // Do not spin on a failing NVML: wait the poll interval out.
                std::thread::sleep(wait);
                Vec::new()
            }
        };
        let now = SystemTime::now();
        let mut changed = false;
        for gpu in self.gpus.clone() {
            changed |= self.probe(gpu, now);
        }
        let live: Vec<LiveInstance> = self.live.values().flatten().cloned().collect();
        changed |= self.state.apply(&events, &live);
        changed |= self.state.expire(now);
        changed
    }

    /// Look at one GPU: lost, present again (= reset), its live instances.
    fn probe(&mut self, gpu: u32, now: SystemTime) -> bool {
        match self.backend.gpu_instances(gpu) {
            Ok(gis) => {
                let was_lost = self.lost.remove(&gpu);
                if was_lost {
                    // A reset GPU may come back with other profiles or MIG mode.
                    self.profiles.remove(&gpu);
                }
                self.refresh_live(gpu, &gis);
                was_lost && self.state.observe_gpu(gpu, true, now)
            }
            Err(e) if e.is_gpu_lost() => {
                self.live.remove(&gpu);
                if self.lost.insert(gpu) {
                    tracing::error!(gpu, error = %e, "GPU lost");
                    self.state.observe_gpu(gpu, false, now)
                } else {
                    false
                }
            }
            Err(e) => {
                tracing::warn!(gpu, error = %e, "reading GPU instances for health; keeping the last ones");
                false
            }
        }
    }

    fn refresh_live(&mut self, gpu: u32, gis: &[carve_gpu::GpuInstanceInfo]) {
        if gis.is_empty() {
            self.live.insert(gpu, Vec::new());
            return;
        }
        if !self.profiles.contains_key(&gpu) {
            match self.backend.profiles(gpu) {
                Ok(p) => {
                    self.profiles.insert(gpu, p);
                }
                Err(e) => {
                    tracing::warn!(gpu, error = %e, "reading MIG profiles for health");
                    return;
                }
            }
        }
        match live_instances(gis, &self.profiles[&gpu]) {
            Ok(l) => {
                self.live.insert(gpu, l);
            }
            Err(e) => {
                tracing::warn!(gpu, error = %e, "mapping GPU instances to devices");
                self.profiles.remove(&gpu);
            }
        }
    }

    fn snapshot(&self, now: SystemTime) -> HealthSnapshot {
        HealthSnapshot {
            generation: self.generation,
            taints: self
                .devices
                .iter()
                .filter_map(|d| {
                    let t = self.state.taints(d);
                    (!t.is_empty()).then(|| (d.to_string(), t))
                })
                .collect(),
            devices: self.state.health(&self.devices, now),
        }
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl HealthMonitor {
    /// Start watching: the first round (start watching events without waiting,
    /// probe every GPU) runs before this returns, so the first snapshot is
    /// already real; then a blocking task loops, waiting up to
    /// [`HealthOptions::poll`] for events each round, and publishes a snapshot
    /// whenever health or taints change. `devices` are every device the node
    /// publishes (the snapshot lists them in this order); the GPUs probed are
    /// theirs. NVML failures are logged and retried next round.
    ///
    /// # Errors
    /// [`HealthError::ZeroPoll`] (nothing started), or [`HealthError::Task`]
    /// when the first round panicked.
    pub async fn start(
        backend: Arc<dyn GpuBackend>,
        events: Arc<dyn GpuEvents>,
        devices: Vec<DeviceName>,
        options: HealthOptions,
    ) -> Result<HealthHandle, HealthError> {
        if options.poll.is_zero() {
            return Err(HealthError::ZeroPoll { poll: options.poll });
        }
        let gpus = devices.iter().map(DeviceName::gpu).collect();
        let mut looper = Looper {
            backend,
            events,
            devices,
            gpus,
            state: HealthState::new(options.policy),
            profiles: BTreeMap::new(),
            live: BTreeMap::new(),
            lost: BTreeSet::new(),
            poll: options.poll,
            generation: 0,
        };
        let (looper, first) = tokio::task::spawn_blocking(move || {
            looper.round(Duration::ZERO);
            let now = SystemTime::now();
            let first = looper.snapshot(now);
            (looper, (first, now))
        })
        .await
        .map_err(|e| HealthError::Task {
            reason: e.to_string(),
        })?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            last_check: AtomicU64::new(unix_secs(first.1)),
        });
        let (tx, rx) = watch::channel(first.0);
        let task = {
            let shared = shared.clone();
            tokio::task::spawn_blocking(move || looper.run(&shared, &tx))
        };
        Ok(HealthHandle {
            rx,
            guard: Arc::new(Guard {
                shared,
                task: Mutex::new(Some(task)),
            }),
        })
    }
}
