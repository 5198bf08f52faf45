//! GPU health in the plugin: a [`HealthMonitor`] that watches NVML health events
//! (through [`GpuEvents`]) and the GPUs themselves (lost or present, live MIG
//! instances through [`GpuBackend`]), folds them into
//! [`carve_model::health::HealthState`], and publishes a [`HealthSnapshot`] on
//! every change; [`apply_taints`] puts a snapshot's taints on built
//! ResourceSlices. The `v1alpha1.DRAResourceHealth` stream on `dra.sock` is
//! served from a [`HealthHandle`] by [`serve_with`], through the
//! [`dra_kubeletplugin`] kit's health service.
//!
//! Not here: classifying events (`carve_model::health`), publishing slices
//! (the caller republishes after [`apply_taints`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_gpu::{GpuBackend, GpuEvents, live_instances};
use carve_model::DeviceName;
use carve_model::MigProfile;
use carve_model::health::{DeviceHealth, HealthPolicy, HealthState, LiveInstance};
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use tokio::sync::watch;

pub use crate::server::{ServeOptions, serve_with};

/// Taints per device the API accepts in Kubernetes 1.34.
pub const MAX_TAINTS_PER_DEVICE_1_34: usize = 4;
/// Taints per device the API accepts from Kubernetes 1.35 on.
pub const MAX_TAINTS_PER_DEVICE: usize = 16;
/// Devices per ResourceSlice the API accepts when any device has taints.
pub const MAX_DEVICES_WITH_TAINTS: usize = 64;

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
    /// A device would get more taints than the API allows.
    #[error(
        "ResourceSlice {slice:?}: device {device} would get {count} taints, the API allows {max}"
    )]
    TooManyTaints {
        /// The slice.
        slice: String,
        /// The device.
        device: String,
        /// Taints it would get.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A slice with tainted devices has more devices than the API then allows.
    #[error(
        "ResourceSlice {slice:?} has {devices} devices and some are tainted; the API allows {max} then"
    )]
    SliceTooLarge {
        /// The slice.
        slice: String,
        /// Its device count.
        devices: usize,
        /// The limit.
        max: usize,
    },
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

/// Set `device.taints` on every device of `slices` from `taints` (by device
/// name), clearing the taints of devices not in the map. Validates first and
/// changes nothing on error: at most `max_per_device` taints per device
/// ([`MAX_TAINTS_PER_DEVICE_1_34`] or [`MAX_TAINTS_PER_DEVICE`]) and at most
/// [`MAX_DEVICES_WITH_TAINTS`] devices in a slice that gets any taint.
/// Returns how many devices got taints.
///
/// # Errors
/// [`HealthError::TooManyTaints`] or [`HealthError::SliceTooLarge`] naming the
/// slice (and device).
pub fn apply_taints(
    slices: &mut [ResourceSlice],
    taints: &BTreeMap<String, Vec<DeviceTaint>>,
    max_per_device: usize,
) -> Result<usize, HealthError> {
    let slice_name = |s: &ResourceSlice| s.metadata.name.clone().unwrap_or_default();
    for s in slices.iter() {
        let devices = s.spec.devices.as_deref().unwrap_or_default();
        let mut tainted = false;
        for d in devices {
            let Some(t) = taints.get(&d.name).filter(|t| !t.is_empty()) else {
                continue;
            };
            tainted = true;
            if t.len() > max_per_device {
                return Err(HealthError::TooManyTaints {
                    slice: slice_name(s),
                    device: d.name.clone(),
                    count: t.len(),
                    max: max_per_device,
                });
            }
        }
        if tainted && devices.len() > MAX_DEVICES_WITH_TAINTS {
            return Err(HealthError::SliceTooLarge {
                slice: slice_name(s),
                devices: devices.len(),
                max: MAX_DEVICES_WITH_TAINTS,
            });
        }
    }
    let mut n = 0;
    for s in slices.iter_mut() {
        for d in s.spec.devices.iter_mut().flatten() {
            d.taints = taints.get(&d.name).filter(|t| !t.is_empty()).cloned();
            n += usize::from(d.taints.is_some());
        }
    }
    Ok(n)
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Device, ResourceSliceSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn slice(name: &str, devices: &[&str]) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: carve_model::DRIVER_NAME.into(),
                devices: Some(
                    devices
                        .iter()
                        .map(|d| Device {
                            name: (*d).into(),
                            ..Device::default()
                        })
                        .collect(),
                ),
                ..ResourceSliceSpec::default()
            },
        }
    }

    fn taint(key: &str) -> DeviceTaint {
        DeviceTaint {
            key: key.into(),
            value: Some("1".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }
    }

    fn taints_of(s: &[ResourceSlice]) -> Vec<(String, usize)> {
        s.iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.clone(), d.taints.as_ref().map_or(0, Vec::len)))
            .collect()
    }

    #[test]
    fn apply_taints_sets_and_clears_by_device_name() {
        let mut s = vec![slice("a", &["gpu-0", "gpu-0-mps"]), slice("b", &["gpu-1"])];
        s[1].spec.devices.as_mut().unwrap()[0].taints = Some(vec![taint("old")]);
        let map = BTreeMap::from([
            ("gpu-0".to_string(), vec![taint("x"), taint("y")]),
            ("gpu-0-mps".to_string(), vec![]),
            ("gpu-9".to_string(), vec![taint("z")]),
        ]);
        assert_eq!(
            apply_taints(&mut s, &map, MAX_TAINTS_PER_DEVICE_1_34).unwrap(),
            1
        );
        assert_eq!(
            taints_of(&s),
            [
                ("gpu-0".to_string(), 2),
                ("gpu-0-mps".to_string(), 0),
                ("gpu-1".to_string(), 0)
            ]
        );
        assert!(s[0].spec.devices.as_ref().unwrap()[1].taints.is_none());
    }

    #[test]
    fn apply_taints_rejects_over_limit_and_changes_nothing() {
        let mut s = vec![slice("a", &["gpu-0"]), slice("b", &["gpu-1"])];
        let five: Vec<DeviceTaint> = (0..5).map(|i| taint(&format!("k{i}"))).collect();
        let map = BTreeMap::from([
            ("gpu-0".to_string(), vec![taint("x")]),
            ("gpu-1".to_string(), five),
        ]);
        let before = s.clone();
        let e = apply_taints(&mut s, &map, MAX_TAINTS_PER_DEVICE_1_34).unwrap_err();
        assert!(
            matches!(&e, HealthError::TooManyTaints { slice, device, count: 5, max: 4 } if slice == "b" && device == "gpu-1"),
            "{e}"
        );
        assert!(e.to_string().contains("gpu-1"), "{e}");
        assert_eq!(s, before, "nothing applied");
        assert_eq!(
            apply_taints(&mut s, &map, MAX_TAINTS_PER_DEVICE).unwrap(),
            2
        );

        let names: Vec<String> = (0..65).map(|i| format!("gpu-0-mig-1g10gb-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut big = vec![slice("big", &refs)];
        let before = big.clone();
        let map = BTreeMap::from([(names[3].clone(), vec![taint("x")])]);
        let e = apply_taints(&mut big, &map, MAX_TAINTS_PER_DEVICE).unwrap_err();
        assert!(
            matches!(&e, HealthError::SliceTooLarge { slice, devices: 65, max: 64 } if slice == "big"),
            "{e}"
        );
        assert_eq!(big, before);
        // Without taints a large slice is fine.
        assert_eq!(
            apply_taints(&mut big, &BTreeMap::new(), MAX_TAINTS_PER_DEVICE).unwrap(),
            0
        );
    }
}
