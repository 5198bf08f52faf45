//! `carve bench prepare`: driver overhead per prepare/unprepare (total minus the
//! time spent inside NVML calls), concurrent throughput over several GPUs, the
//! RSS of the real `carve kubelet-plugin` process after many claims, and the
//! time from process start to a registration socket that answers `GetInfo`.
//!
//! Everything runs on the NVML simulator library behind the real
//! `NvmlBackend`, against the API-server stand-in over HTTP, configured as the
//! Helm chart deploys the plugin: with a pod UID (every operation takes the
//! host lock and rereads the checkpoint's bytes, parsing them only when
//! another process wrote them), with metrics (the GI/CI gauges are read from
//! NVML on every call) and, for the process, the chart's `MALLOC_ARENA_MAX`. It prints figures next to their targets, with the
//! ratio value/target; it never asserts timings.
//!
//! "Overhead" is a call's wall time minus the time spent inside `GpuBackend`
//! calls (NVML and its Rust wrapper). It still contains the checkpoint fsyncs
//! (the disk's time, printed separately and subtracted in a second row) and
//! the claim GET of a prepare to a stand-in in this process, on a thread of
//! its own (timed alone in its own row). The status PATCH that follows a
//! prepare runs in the background (the kubelet does not wait for it). An
//! unprepare that comes while it is still in flight waits for it; on a node
//! the pod's run lies between the two, so the benchmark lets the write finish
//! before timing the claim's unprepare (the PATCH alone has its own row).
//!
//! Wall time on a shared machine moves with whatever else runs (a preempted
//! thread, a late wake-up). Next to it, each call's CPU time: what this
//! process's threads but the stand-in's used during the call (the driver on
//! the runtime thread, its blocking threads, the kube client), minus the CPU
//! time inside NVML calls. It leaves out waiting, so a busy machine moves it
//! less than the wall time (though still some: shared caches and cores). It
//! is read from each thread's CPU clock; the row says so where there is none.
//!
//! The plugin fsyncs a checkpoint write only when it records (or
//! replaces a file that records) a GPU whose MIG mode the plugin enabled, the
//! one state in it that a reboot does not undo (see `carve_plugin`'s
//! checkpoint module): the simulated GPUs start in MIG mode, so the benchmark
//! counts 0 fsyncs per call (but for the first write after the plugin starts,
//! whose spare file may hold an earlier boot's checkpoint), and a node where
//! the plugin turned MIG mode on pays one fsync per checkpoint write (1 per
//! prepare, 2 per unprepare), which the fsync row then shows. It is not a load test of a
//! real GPU: simulator calls are far faster than NVML on hardware, which is
//! why NVML time is measured and subtracted rather than assumed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use carve_apiserver::{ApiServer, Options, Resource, Store};
use carve_gpu::{
    BackendError, ComputeInstanceInfo, ComputeMode, ComputeTarget, GpuBackend, GpuInfo,
    GpuInstanceInfo, MigMode,
};
use carve_model::{DeviceName, GpuModel, MigProfile, Placement};
use carve_nvml::{NvmlBackend, NvmlOptions};
use carve_plugin::testing::{FakeKubelet, uds_channel};
use carve_plugin::{Checkpoint, ClaimRef, Driver, PluginConfig, ReadClaim, Retry, SocketPaths};
use kube::Api;
use kube::api::{Patch, PatchParams};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

/// Per-call driver overhead target (p99, NVML time excluded).
const OVERHEAD_TARGET: Duration = Duration::from_millis(1);
/// Plugin RSS target, bytes (MB = 10^6 bytes).
const RSS_TARGET_BYTES: u64 = 20_000_000;
/// Start-to-registered target.
const START_TARGET: Duration = Duration::from_secs(1);
/// Peak RSS of NVIDIA's Go plugin printing `--help`, bytes.
const NVIDIA_HELP_RSS_BYTES: u64 = 58_000_000;
/// How often plugin starts are timed.
const STARTS: usize = 5;
/// Longest wait for a plugin to register or exit.
const PROCESS_DEADLINE: Duration = Duration::from_secs(30);
/// The pod UID the plugin runs with (the chart passes `--pod-uid`).
const POD_UID: &str = "bench-pod";
/// glibc malloc arenas, as `deploy/helm/carve/templates/daemonset.yaml` sets
/// them for the plugin container: one arena instead of one per thread that
/// ever allocated (tokio workers and blocking threads).
const MALLOC_ARENA_MAX: &str = "1";
/// API-server round trips timed alone per kind.
const API_SAMPLES: usize = 200;
/// Name of the stand-in's threads (the API server's work, left out of the
/// driver's CPU time).
const STAND_IN_THREAD: &str = "api-stand-in";

#[derive(Debug, Clone, clap::Args)]
pub struct PrepareBench {
    /// Prepare+unprepare cycles: timed one at a time, then again concurrently,
    /// and driven through the plugin process for its RSS.
    #[arg(long, default_value_t = 1000)]
    pub iterations: u32,
    /// Simulated GPUs on the node.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Claims prepared at once in the throughput run (at most one per
    /// smallest-profile placement of the node: 56 on 8 H100s).
    #[arg(long, default_value_t = 56)]
    pub concurrency: u32,
    /// GPU model of the simulated node (MIG-capable).
    #[arg(long, default_value = "h100-80gb")]
    pub model: String,
    /// Skip the plugin-process part (RSS, time to registration).
    #[arg(long)]
    pub skip_rss: bool,
    /// The NVML simulator library (default: next to this executable).
    #[arg(long)]
    pub nvml_sim_lib: Option<PathBuf>,
    /// Where the plugin's files go (checkpoint, sockets): the node's disk by
    /// default; `/dev/shm` takes disk flushes out of the figures.
    #[arg(long, default_value = "/tmp")]
    pub files_dir: PathBuf,
    /// Where the CDI specs go: a tmpfs (`/dev/shm` where the host has it) by
    /// default, as `/var/run/cdi`, where the chart puts them, is on a node.
    #[arg(long)]
    pub cdi_dir: Option<PathBuf>,
    /// Run without a pod UID (no host lock, no checkpoint reread per
    /// operation), unlike the Helm chart.
    #[arg(long)]
    pub without_pod_uid: bool,
}

impl PrepareBench {
    /// `--cdi-dir`, or a tmpfs where the host has one.
    fn cdi_dir(&self) -> PathBuf {
        self.cdi_dir.clone().unwrap_or_else(sim_parent)
    }
}

/// A [`GpuBackend`] that delegates every call to the real backend and sums the
/// time spent inside it (wall time, and the calling thread's CPU time):
/// measurement instrumentation, not a stand-in.
#[derive(Debug)]
pub(crate) struct TimedBackend {
    inner: Arc<dyn GpuBackend>,
    nanos: AtomicU64,
    cpu_nanos: AtomicU64,
    calls: AtomicU64,
    gi_created: AtomicU64,
    gi_destroyed: AtomicU64,
    ci_created: AtomicU64,
    ci_destroyed: AtomicU64,
}

/// Counters of a [`TimedBackend`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub nanos: u64,
    /// CPU time of the calling threads inside the calls (0 where the
    /// thread CPU clock is unavailable).
    pub cpu_nanos: u64,
    pub calls: u64,
    pub gi_created: u64,
    pub gi_destroyed: u64,
    pub ci_created: u64,
    pub ci_destroyed: u64,
}

impl TimedBackend {
    pub(crate) fn new(inner: Arc<dyn GpuBackend>) -> Self {
        Self {
            inner,
            nanos: AtomicU64::new(0),
            cpu_nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            gi_created: AtomicU64::new(0),
            gi_destroyed: AtomicU64::new(0),
            ci_created: AtomicU64::new(0),
            ci_destroyed: AtomicU64::new(0),
        }
    }

    pub(crate) fn counts(&self) -> Counts {
        Counts {
            nanos: self.nanos.load(Ordering::SeqCst),
            cpu_nanos: self.cpu_nanos.load(Ordering::SeqCst),
            calls: self.calls.load(Ordering::SeqCst),
            gi_created: self.gi_created.load(Ordering::SeqCst),
            gi_destroyed: self.gi_destroyed.load(Ordering::SeqCst),
            ci_created: self.ci_created.load(Ordering::SeqCst),
            ci_destroyed: self.ci_destroyed.load(Ordering::SeqCst),
        }
    }

    fn timed<T>(&self, f: impl FnOnce(&dyn GpuBackend) -> T) -> T {
        let cpu = ThreadCpu::own();
        let t = Instant::now();
        let r = f(&*self.inner);
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let (Some(before), Some(after)) = (cpu, ThreadCpu::own()) {
            let cpu_ns = after.saturating_sub(before).as_nanos();
            self.cpu_nanos
                .fetch_add(u64::try_from(cpu_ns).unwrap_or(u64::MAX), Ordering::SeqCst);
        }
        self.nanos.fetch_add(ns, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        r
    }

    fn count_ok<T>(r: &Result<T, BackendError>, c: &AtomicU64) {
        if r.is_ok() {
            c.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl GpuBackend for TimedBackend {
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.timed(|b| b.gpus())
    }
    fn profiles(&self, gpu: u32) -> Result<Vec<MigProfile>, BackendError> {
        self.timed(|b| b.profiles(gpu))
    }
    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        self.timed(|b| b.mig_mode(gpu))
    }
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigMode, BackendError> {
        self.timed(|b| b.set_mig_mode(gpu, enabled))
    }
    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceInfo>, BackendError> {
        self.timed(|b| b.gpu_instances(gpu))
    }
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: Placement,
    ) -> Result<GpuInstanceInfo, BackendError> {
        let r = self.timed(|b| b.create_gpu_instance(gpu, profile_id, placement));
        Self::count_ok(&r, &self.gi_created);
        r
    }
    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<ComputeInstanceInfo, BackendError> {
        let r = self.timed(|b| b.create_compute_instance(gpu, gi));
        Self::count_ok(&r, &self.ci_created);
        r
    }
    fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError> {
        let r = self.timed(|b| b.destroy_compute_instance(gpu, gi, ci));
        Self::count_ok(&r, &self.ci_destroyed);
        r
    }
    fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        let r = self.timed(|b| b.destroy_gpu_instance(gpu, gi));
        Self::count_ok(&r, &self.gi_destroyed);
        r
    }
    fn capability_minor(
        &self,
        gpu_minor: u32,
        gi: u32,
        ci: Option<u32>,
    ) -> Result<u32, BackendError> {
        self.timed(|b| b.capability_minor(gpu_minor, gi, ci))
    }
    fn compute_mode(&self, target: ComputeTarget) -> Result<ComputeMode, BackendError> {
        self.timed(|b| b.compute_mode(target))
    }
    fn set_compute_mode(
        &self,
        target: ComputeTarget,
        mode: ComputeMode,
    ) -> Result<(), BackendError> {
        self.timed(|b| b.set_compute_mode(target, mode))
    }
}

/// Directory for simulator state: tmpfs when the host has `/dev/shm`.
fn sim_parent() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// One simulated node on disk: plugin directories under a temp dir (the
/// node's ordinary file system), CDI specs and simulator state on tmpfs, a
/// private copy of the simulator library with its side-car configuration.
#[derive(Debug)]
struct BenchNode {
    dir: tempfile::TempDir,
    _sim_dir: tempfile::TempDir,
    _cdi_dir: tempfile::TempDir,
    lib: PathBuf,
    sidecar: PathBuf,
    sim: SimConfig,
    config: PluginConfig,
}

const NODE: &str = "bench-node";

impl BenchNode {
    /// The node the arguments `a` describe: `a.gpus` GPUs of `model`, plugin
    /// files under `a.files_dir`, CDI specs under `a.cdi_dir()`, a pod UID
    /// unless `a.without_pod_uid`.
    fn new(a: &PrepareBench, model: &GpuModel, lib_src: &Path) -> anyhow::Result<Self> {
        let (model, gpus, files_dir, cdi_dir) = (model.key, a.gpus, &a.files_dir, &a.cdi_dir());
        let pod_uid = !a.without_pod_uid;
        // Short base path: socket paths must fit in sockaddr_un (108 bytes).
        let dir = tempfile::Builder::new()
            .prefix("cbp")
            .tempdir_in(files_dir)
            .with_context(|| format!("--files-dir {}: creating a temp dir", files_dir.display()))?;
        let sim_parent = sim_parent();
        let sim_dir = tempfile::Builder::new()
            .prefix("carve-bench-sim")
            .tempdir_in(&sim_parent)
            .with_context(|| format!("creating a temp dir in {}", sim_parent.display()))?;
        let cdi = tempfile::Builder::new()
            .prefix("carve-bench-cdi")
            .tempdir_in(cdi_dir)
            .with_context(|| format!("--cdi-dir {}: creating a temp dir", cdi_dir.display()))?;
        let d = dir.path();
        let lib = d.join("libnvidia_ml_sim.so");
        std::fs::copy(lib_src, &lib)
            .with_context(|| format!("copying {} to {}", lib_src.display(), lib.display()))?;
        let sim = SimConfig::new(NODE, vec![GpuEntry::new(model, gpus, true)], sim_dir.path());
        let mut side = lib.as_os_str().to_owned();
        side.push(nvidia_ml_sim::SIDECAR_SUFFIX);
        let sidecar = PathBuf::from(side);
        sim.to_file(&sidecar)?;
        std::fs::write(d.join("boot_id"), "bench-boot\n").context("writing boot id")?;
        // The driver files the CDI specs name (a fake driver root).
        let driver = nvidia_ml_sim::driver_root::write_fake_driver(
            d,
            &sim.driver_version,
            &(0..gpus).collect::<Vec<_>>(),
        )
        .context("writing the fake NVIDIA driver root")?;
        let mut c = PluginConfig::new(NODE);
        c.driver.container_root.clone_from(&driver.root);
        c.driver.host_root = driver.root;
        c.driver.proc_devices = driver.devices_file;
        c.driver.proc_driver_nvidia.clone_from(&sim.proc_root);
        c.plugins_registry_dir = d.join("registry");
        c.plugin_dir = d.join("plugins");
        c.cdi_dir = cdi.path().to_path_buf();
        c.checkpoint_path = d.join("state").join("checkpoint.json");
        c.boot_id_path = d.join("boot_id");
        c.gc_interval = None;
        c.pod_uid = pod_uid.then(|| POD_UID.to_string());
        // The chart serves metrics: GI/CI gauges are read on every call.
        c.metrics = Some(Arc::new(carve_metrics::Metrics::new()));
        c.unprepare_retry = Retry {
            attempts: 3,
            initial: Duration::from_millis(1),
            max: Duration::from_millis(4),
        };
        for p in [
            &c.plugins_registry_dir,
            &c.plugin_dir,
            &c.cdi_dir,
            &d.join("state"),
        ] {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        Ok(Self {
            dir,
            _sim_dir: sim_dir,
            _cdi_dir: cdi,
            lib,
            sidecar,
            sim,
            config: c,
        })
    }

    fn backend(&self) -> anyhow::Result<Arc<dyn GpuBackend>> {
        let b = NvmlBackend::open(NvmlOptions {
            lib_path: Some(self.lib.clone()),
            proc_root: self.sim.proc_root.clone(),
        })
        .with_context(|| format!("opening the NVML simulator {}", self.lib.display()))?;
        Ok(Arc::new(b))
    }

    /// GPU instances alive per the simulator's persisted state.
    fn live_instances(&self) -> anyhow::Result<usize> {
        let s = SimState::load(&self.sim.state_file)?;
        Ok(s.map_or(0, |s| s.gpus.iter().map(|g| g.gpu_instances.len()).sum()))
    }

    fn cdi_files(&self) -> usize {
        std::fs::read_dir(&self.config.cdi_dir)
            .map(|rd| rd.flatten().count())
            .unwrap_or(0)
    }
}

/// Store an allocated ResourceClaim naming one device of this node's pool,
/// as the API server returns it once the scheduler allocated it for a pod:
/// made from the pod's claim template (owner reference, annotation,
/// finalizer), reserved for the pod, allocated on the node, and with the
/// `managedFields` that the resource-claim controller's create and the
/// scheduler's status update leave on it. The driver reads and parses all of
/// this on every prepare, so the benchmark's claims carry it too.
fn put_claim(store: &Store, name: &str, uid: &str, device: &str) -> anyhow::Result<ClaimRef> {
    let pod_uid = format!("pod-{uid}");
    let time = "2026-11-29T10:00:00Z";
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {
            "name": name, "namespace": "default", "uid": uid,
            "generateName": format!("{name}-gpu-"),
            "creationTimestamp": time,
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "finalizers": ["resource.kubernetes.io/delete-protection"],
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod_uid,
                "controller": true, "blockOwnerDeletion": true
            }],
            "managedFields": [
                {
                    "manager": "kube-controller-manager", "operation": "Update",
                    "apiVersion": "resource.k8s.io/v1", "time": time, "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:metadata": {
                            "f:annotations": {".": {}, "f:resource.kubernetes.io/pod-claim-name": {}},
                            "f:generateName": {},
                            "f:ownerReferences": {".": {}, format!("k:{{\"uid\":\"{pod_uid}\"}}"): {}}
                        },
                        "f:spec": {"f:devices": {"f:requests": {}}}
                    }
                },
                {
                    "manager": "kube-scheduler", "operation": "Update",
                    "apiVersion": "resource.k8s.io/v1", "time": time, "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {
                        "f:status": {
                            "f:allocation": {".": {}, "f:allocationTimestamp": {}, "f:devices": {".": {}, "f:results": {}}, "f:nodeSelector": {}},
                            "f:reservedFor": {
                                ".": {},
                                format!("k:{{\"resource\":\"pods\",\"uid\":\"{pod_uid}\"}}"): {
                                    ".": {}, "f:name": {}, "f:resource": {}, "f:uid": {}
                                }
                            }
                        }
                    }
                }
            ]
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "mig.gpu.carve.dev", "allocationMode": "ExactCount", "count": 1
        }}]}},
        "status": {
            "allocation": {
                "allocationTimestamp": time,
                "devices": {"results": [
                    {"request": "gpu", "driver": carve_model::DRIVER_NAME, "pool": NODE, "device": device}
                ], "config": []},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}
                ]}]}
            },
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod_uid}]
        }
    });
    store
        .insert(Resource::ResourceClaims, obj)
        .with_context(|| format!("storing ResourceClaim {name}"))?;
    Ok(ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    })
}

/// Every (profile, placement) of the model, for the one-at-a-time run.
fn all_placements(model: &GpuModel) -> Vec<(String, u8)> {
    let spec = model.spec();
    spec.profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(|pl| (p.name.clone(), pl.start)))
        .collect()
}

/// `concurrency` devices that can be live at once: the smallest profile's
/// placements, spread round-robin over the GPUs.
fn concurrent_devices(
    model: &GpuModel,
    gpus: u32,
    concurrency: u32,
) -> anyhow::Result<Vec<String>> {
    let spec = model.spec();
    let smallest = spec
        .profiles
        .iter()
        .filter(|p| !p.placements.is_empty())
        .min_by_key(|p| (p.memory_slices, p.compute_slices))
        .with_context(|| format!("model {} has no MIG profiles", model.key))?;
    // Placements that do not overlap each other (greedy by start).
    let mut starts: Vec<Placement> = Vec::new();
    for pl in &smallest.placements {
        if starts.iter().all(|s| !s.overlaps(*pl)) {
            starts.push(*pl);
        }
    }
    let capacity = u64::from(gpus) * starts.len() as u64;
    if u64::from(concurrency) > capacity || concurrency == 0 {
        bail!(
            "--concurrency {concurrency}: must be 1..={capacity} ({gpus} GPUs x {} placements of {} on {})",
            starts.len(),
            smallest.name,
            model.key
        );
    }
    (0..concurrency)
        .map(|j| {
            let gpu = j % gpus;
            let slot = (j / gpus) as usize;
            Ok(DeviceName::mig(gpu, &smallest.name, starts[slot].start)?.to_string())
        })
        .collect()
}

fn check_args(a: &PrepareBench) -> anyhow::Result<&'static GpuModel> {
    if a.iterations == 0 {
        bail!("--iterations must be at least 1");
    }
    if a.gpus == 0 {
        bail!("--gpus must be at least 1");
    }
    let model = GpuModel::find(&a.model).with_context(|| {
        format!(
            "--model {:?}: unknown GPU model; known: {}",
            a.model,
            GpuModel::keys().join(", ")
        )
    })?;
    if model.spec().profiles.is_empty() {
        bail!("--model {}: not MIG-capable", model.key);
    }
    concurrent_devices(model, a.gpus, a.concurrency)?;
    Ok(model)
}

/// One timed call.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Call {
    /// Wall time.
    pub total: Duration,
    /// Inside `GpuBackend` calls.
    pub nvml: Duration,
    /// CPU time of the threads that made them, inside them.
    pub nvml_cpu: Duration,
    /// Inside checkpoint fsyncs.
    pub sync: Duration,
    /// Checkpoint fsyncs.
    pub syncs: u64,
    /// CPU time of this process's threads but the stand-in's during the
    /// call; `None` where the kernel does not report per-thread CPU time.
    pub cpu: Option<Duration>,
}

impl Call {
    fn overhead(&self) -> Duration {
        self.total.saturating_sub(self.nvml)
    }

    /// CPU time minus the CPU time inside NVML.
    fn cpu_overhead(&self) -> Option<Duration> {
        self.cpu.map(|c| c.saturating_sub(self.nvml_cpu))
    }
}

/// CPU time used so far by the threads of this process, but those named
/// `skip`, each read from its thread CPU clock (as `pthread_getcpuclockid`
/// makes it; exact also for a thread that is running). The threads are
/// listed from `/proc/self/task`. `None` where that or the clocks are
/// unavailable.
struct ThreadCpu {
    own: Duration,
    others: BTreeMap<i32, u64>,
}

impl ThreadCpu {
    /// Read the other threads first and this one last, so that reading
    /// costs as little as possible of the span it opens.
    fn before(skip: &str) -> Option<Self> {
        let others = Self::others(skip)?;
        Some(Self {
            own: Self::own()?,
            others,
        })
    }

    /// CPU time used since `self`; this thread read first.
    fn since(&self, skip: &str) -> Option<Duration> {
        let own = Self::own()?.saturating_sub(self.own);
        let others: u64 = Self::others(skip)?
            .iter()
            .map(|(tid, ns)| ns.saturating_sub(self.others.get(tid).copied().unwrap_or(0)))
            .sum();
        Some(own + Duration::from_nanos(others))
    }

    fn own() -> Option<Duration> {
        Self::clock(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
    }

    fn clock(id: nix::time::ClockId) -> Option<Duration> {
        Some(Duration::from(nix::time::clock_gettime(id).ok()?))
    }

    /// The CPU clock of thread `tid` of this process: the kernel's encoding
    /// of a per-thread scheduler clock, `(!tid << 3) | PERTHREAD | SCHED`.
    fn thread_clock(tid: i32) -> nix::time::ClockId {
        const CPUCLOCK_PERTHREAD: i32 = 4;
        const CPUCLOCK_SCHED: i32 = 2;
        nix::time::ClockId::from_raw((!tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED)
    }

    fn others(skip: &str) -> Option<BTreeMap<i32, u64>> {
        let me = nix::unistd::gettid().as_raw();
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir("/proc/self/task").ok()? {
            let entry = entry.ok()?;
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<i32>().ok())
            else {
                continue;
            };
            if tid == me {
                continue;
            }
            // A thread that exited since the listing is skipped.
            let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
                continue;
            };
            if comm.trim_end() == skip {
                continue;
            }
            if let Some(t) = Self::clock(Self::thread_clock(tid)) {
                out.insert(tid, u64::try_from(t.as_nanos()).ok()?);
            }
        }
        Some(out)
    }
}

/// Figures of the in-process part.
#[derive(Debug, Default)]
pub(crate) struct InProcess {
    /// Per prepare call.
    pub prepare: Vec<Call>,
    /// Per unprepare call.
    pub unprepare: Vec<Call>,
    /// Claim GET and status PATCH round trips to the stand-in, timed alone.
    pub api_get: Vec<Duration>,
    pub api_patch: Vec<Duration>,
    /// Round trips to a blocking thread and back with nothing to do, on the
    /// plugin's runtime: the hand-off each NVML hop of the driver pays.
    pub hop: Vec<Duration>,
    /// Context switches of this whole process (plugin core, stand-in,
    /// runtime) per one-at-a-time prepare+unprepare cycle: thread hand-offs,
    /// counted rather than timed, so it does not move with machine load.
    pub switches_per_cycle: f64,
    /// Claims in the concurrent run.
    pub concurrent_claims: u64,
    /// Wall time of all concurrent prepares.
    pub concurrent_prepare_wall: Duration,
    /// Wall time of all concurrent unprepares.
    pub concurrent_unprepare_wall: Duration,
    /// Backend counters at the end.
    pub counts: Counts,
    /// Prepares and unprepares that succeeded.
    pub prepares_ok: u64,
    pub unprepares_ok: u64,
    /// GPU instances alive at the end (simulator state).
    pub live_at_end: usize,
    /// CDI specs left at the end.
    pub cdi_left: usize,
}

/// The in-process part: one at a time, then `concurrency` at once.
pub(crate) async fn in_process(
    a: &PrepareBench,
    model: &GpuModel,
    lib: &Path,
    stand_in: &tokio::runtime::Handle,
) -> anyhow::Result<InProcess> {
    let node = BenchNode::new(a, model, lib)?;
    // The stand-in serves from a thread of its own, as an API server elsewhere
    // would: every response wakes the driver's thread.
    let api = stand_in
        .spawn(ApiServer::start(Options::default()))
        .await
        .context("starting the API-server stand-in")??;
    let store = api.store();
    let timed = Arc::new(TimedBackend::new(node.backend()?));
    let driver = Driver::new(node.config.clone(), timed.clone(), api.try_client()?).await?;
    driver.recover().await?;
    let mut out = InProcess::default();

    // One at a time over every profile placement, GPUs in turn.
    let placements = all_placements(model);
    let mut seq = Vec::new();
    for i in 0..a.iterations {
        let (profile, start) = &placements[i as usize % placements.len()];
        let dev = DeviceName::mig(i % a.gpus, profile, *start)?.to_string();
        seq.push(put_claim(
            &store,
            &format!("seq-{i}"),
            &format!("uid-seq-{i}"),
            &dev,
        )?);
    }
    let start = || {
        (
            ThreadCpu::before(STAND_IN_THREAD),
            timed.counts(),
            Checkpoint::sync_totals(),
            Instant::now(),
        )
    };
    type Started = (Option<ThreadCpu>, Counts, (u64, Duration), Instant);
    let call = |(cpu, counts, (syncs, sync), t): Started| {
        let total = t.elapsed();
        let cpu = cpu.and_then(|c| c.since(STAND_IN_THREAD));
        let (syncs2, sync2) = Checkpoint::sync_totals();
        let now = timed.counts();
        Call {
            total,
            nvml: Duration::from_nanos(now.nanos - counts.nanos),
            nvml_cpu: Duration::from_nanos(now.cpu_nanos - counts.cpu_nanos),
            sync: sync2.saturating_sub(sync),
            syncs: syncs2 - syncs,
            cpu,
        }
    };
    let switches = || {
        nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
            .map(|u| u.voluntary_context_switches() + u.involuntary_context_switches())
            .context("getrusage(RUSAGE_SELF)")
    };
    let switches_before = switches()?;
    for c in &seq {
        let s = start();
        driver
            .prepare_one(c)
            .await
            .with_context(|| format!("prepare {c}"))?;
        out.prepare.push(call(s));
        out.prepares_ok += 1;
        // On a node the pod runs between the two, and the prepare's status
        // write (background, not waited for by the kubelet) is long done
        // when the unprepare comes: let it finish outside the timed span.
        driver.settle_status_writes().await;
        let s = start();
        driver
            .unprepare_one(&c.uid)
            .await
            .with_context(|| format!("unprepare {c}"))?;
        out.unprepare.push(call(s));
        out.unprepares_ok += 1;
    }

    out.switches_per_cycle = (switches()? - switches_before) as f64 / seq.len().max(1) as f64;

    // The API-server round trips of a prepare, alone: the claim GET and the
    // status PATCH (the same requests the driver sends, read as it reads
    // them), and the hand-off of an NVML hop with nothing in it.
    let client = api.try_client()?;
    let claims: Api<ReadClaim> = Api::namespaced(client, "default");
    let probe = seq.first().context("no claims")?;
    let patch = serde_json::json!({"status": {"devices": []}});
    for _ in 0..API_SAMPLES {
        let t = Instant::now();
        claims
            .get_opt(&probe.name)
            .await
            .with_context(|| format!("GET ResourceClaim {probe}"))?
            .with_context(|| format!("ResourceClaim {probe} is gone"))?;
        out.api_get.push(t.elapsed());
        let t = Instant::now();
        claims
            .patch_status(&probe.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("PATCH ResourceClaim {probe} status"))?;
        out.api_patch.push(t.elapsed());
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ())
            .await
            .context("a blocking thread")?;
        out.hop.push(t.elapsed());
    }

    // `concurrency` claims at once, in rounds.
    let devices = concurrent_devices(model, a.gpus, a.concurrency)?;
    let rounds = (a.iterations / a.concurrency).max(1);
    let mut all = Vec::new();
    for r in 0..rounds {
        let batch: Vec<ClaimRef> = devices
            .iter()
            .enumerate()
            .map(|(j, d)| {
                put_claim(
                    &store,
                    &format!("con-{r}-{j}"),
                    &format!("uid-con-{r}-{j}"),
                    d,
                )
            })
            .collect::<anyhow::Result<_>>()?;
        all.push(batch);
    }
    for batch in &all {
        let t = Instant::now();
        let res = futures::future::join_all(batch.iter().map(|c| driver.prepare_one(c))).await;
        out.concurrent_prepare_wall += t.elapsed();
        for (c, r) in batch.iter().zip(res) {
            r.with_context(|| format!("concurrent prepare {c}"))?;
            out.prepares_ok += 1;
        }
        let t = Instant::now();
        let res =
            futures::future::join_all(batch.iter().map(|c| driver.unprepare_one(&c.uid))).await;
        out.concurrent_unprepare_wall += t.elapsed();
        for (c, r) in batch.iter().zip(res) {
            r.with_context(|| format!("concurrent unprepare {c}"))?;
            out.unprepares_ok += 1;
        }
        out.concurrent_claims += batch.len() as u64;
    }
    out.counts = timed.counts();
    drop(driver);
    out.live_at_end = node.live_instances()?;
    out.cdi_left = node.cdi_files();
    api.shutdown().await;
    Ok(out)
}

/// Figures of the plugin-process part.
#[derive(Debug, Default)]
struct ProcessFigures {
    starts: Vec<Duration>,
    /// VmRSS, VmHWM, RssAnon, RssFile once registered.
    rss_idle_kib: [u64; 4],
    /// The same after the cycles.
    rss_after_kib: [u64; 4],
    rss_kib: u64,
    hwm_kib: u64,
    /// Resident KiB per mapping once registered, largest first.
    rss_idle_by_mapping: Vec<(String, u64)>,
    /// Resident KiB per mapping after the cycles, largest first.
    rss_by_mapping: Vec<(String, u64)>,
    cycles: u64,
    help_peak_kib: u64,
    live_at_end: usize,
}

/// `VmRSS`, `VmHWM`, `RssAnon` and `RssFile` of a process, KiB.
fn proc_rss(pid: u32) -> anyhow::Result<[u64; 4]> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{path}: no {name} line"))
    };
    Ok([
        field("VmRSS:")?,
        field("VmHWM:")?,
        field("RssAnon:")?,
        field("RssFile:")?,
    ])
}

/// Resident KiB of a process per mapping, largest first: the file name of a
/// file mapping (`carve`, `libc.so.6`, ...), `[heap]`, `[stack]`, and
/// `anon` for the unnamed anonymous ones (thread stacks, mmapped allocations).
fn proc_rss_by_mapping(pid: u32) -> anyhow::Result<Vec<(String, u64)>> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            *by.entry(current.clone()).or_default() += kib;
        } else if line
            .split_whitespace()
            .next()
            .is_some_and(|range| range.contains('-') && !range.ends_with(':'))
        {
            // `start-end perms offset dev inode [path]`
            current = match line.split_whitespace().nth(5) {
                Some(p) if p.starts_with('[') => p.to_string(),
                Some(p) => Path::new(p)
                    .file_name()
                    .map_or_else(|| p.to_string(), |n| n.to_string_lossy().into_owned()),
                None => "anon".to_string(),
            };
        }
    }
    let mut v: Vec<(String, u64)> = by.into_iter().filter(|(_, k)| *k > 0).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(v)
}

/// The largest peak RSS (KiB) among this process's reaped children.
fn children_max_rss_kib() -> anyhow::Result<u64> {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .context("getrusage(RUSAGE_CHILDREN)")?;
    Ok(u64::try_from(u.max_rss()).unwrap_or(0))
}

struct Plugin {
    child: tokio::process::Child,
    log: PathBuf,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("pid", &self.child.id())
            .field("log", &self.log)
            .finish()
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(4000);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    s[start..].to_string()
}

impl Plugin {
    /// Spawn `carve kubelet-plugin` for `node`; returns it with the start instant.
    fn spawn(
        carve: &Path,
        node: &BenchNode,
        api_url: &str,
        n: usize,
    ) -> anyhow::Result<(Self, Instant)> {
        let c = &node.config;
        let reg = node.registration_socket()?;
        if reg.exists() {
            std::fs::remove_file(&reg)
                .with_context(|| format!("removing stale {}", reg.display()))?;
        }
        let log = node.dir.path().join(format!("plugin-{n}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let s = |p: &Path| p.display().to_string();
        let mut cmd = tokio::process::Command::new(carve);
        cmd.arg("kubelet-plugin")
            .args(["--node-name", NODE])
            .args(["--plugins-dir", &s(&c.plugin_dir)])
            .args(["--registry-dir", &s(&c.plugins_registry_dir)])
            .args(["--cdi-dir", &s(&c.cdi_dir)])
            .args(["--state-dir", &s(&node.dir.path().join("state"))])
            .args(["--proc-driver-nvidia", &s(&node.sim.proc_root)])
            .args(["--container-driver-root", &s(&c.driver.container_root)])
            .args(["--host-driver-root", &s(&c.driver.host_root)])
            .args(["--proc-devices", &s(&c.driver.proc_devices)])
            .args(["--nvml-lib", &s(&node.lib)])
            .args(["--kube-api-url", api_url])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(c.pod_uid.iter().flat_map(|u| ["--pod-uid", u.as_str()]))
            .env("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
            .env(nvidia_ml_sim::CONFIG_ENV, &node.sidecar)
            .env_remove(nvidia_ml_sim::FAULTS_ENV)
            .env_remove("CARVE_NVML_LIB")
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true);
        let t0 = Instant::now();
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {} kubelet-plugin", carve.display()))?;
        Ok((Self { child, log }, t0))
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.child.id().context("plugin process already reaped")
    }

    /// Wait until the registration socket answers `GetInfo` (polled every
    /// 200 µs: this is a measurement, not a test wait).
    async fn wait_registered(&mut self, reg: &Path) -> anyhow::Result<()> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                bail!(
                    "carve kubelet-plugin exited with {st} before registering; its log:\n{}",
                    tail(&self.log)
                );
            }
            if reg.exists()
                && let Ok(ch) = uds_channel(reg).await
            {
                let mut r =
                    carve_proto::registration::registration_client::RegistrationClient::new(ch);
                if r.get_info(carve_proto::registration::InfoRequest {})
                    .await
                    .is_ok()
                {
                    return Ok(());
                }
            }
            if t0.elapsed() > PROCESS_DEADLINE {
                bail!(
                    "carve kubelet-plugin did not answer GetInfo on {} within {PROCESS_DEADLINE:?}; its log:\n{}",
                    reg.display(),
                    tail(&self.log)
                );
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within the deadline; reaps it.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        match tokio::time::timeout(PROCESS_DEADLINE, self.child.wait()).await {
            Ok(r) => {
                r?;
            }
            Err(_) => {
                self.child.kill().await?;
            }
        }
        Ok(())
    }
}

impl BenchNode {
    fn registration_socket(&self) -> anyhow::Result<PathBuf> {
        Ok(SocketPaths::new(&self.config)?.registration)
    }
}

/// `carve --help` peak RSS (KiB) from the kernel's high-water mark of the
/// reaped child (the counter behind VmHWM; /proc is gone once it exits).
/// Linux also counts the memory the child had before `exec`, i.e. this
/// process's at spawn: run first, while this process is small, and still an
/// upper bound. Also one when this process reaped a bigger child earlier.
fn help_peak_kib(carve: &Path) -> anyhow::Result<u64> {
    let st = std::process::Command::new(carve)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .with_context(|| format!("running {} --help", carve.display()))?;
    if !st.success() {
        bail!("{} --help exited with {st}", carve.display());
    }
    children_max_rss_kib()
}

async fn plugin_process(
    a: &PrepareBench,
    model: &GpuModel,
    lib: &Path,
    help_kib: u64,
) -> anyhow::Result<ProcessFigures> {
    let carve = std::env::current_exe().context("locating this executable")?;
    let mut f = ProcessFigures {
        help_peak_kib: help_kib,
        ..ProcessFigures::default()
    };

    let node = BenchNode::new(a, model, lib)?;
    let api = ApiServer::start(Options::default()).await?;
    let store = api.store();
    let reg = node.registration_socket()?;

    for n in 0..STARTS {
        let (mut p, t0) = Plugin::spawn(&carve, &node, &api.url(), n)?;
        p.wait_registered(&reg).await?;
        f.starts.push(t0.elapsed());
        p.stop().await?;
    }

    let (mut p, _) = Plugin::spawn(&carve, &node, &api.url(), STARTS)?;
    p.wait_registered(&reg).await?;
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME).await?;
    f.rss_idle_kib = proc_rss(p.pid()?)?;
    f.rss_idle_by_mapping = proc_rss_by_mapping(p.pid()?)?;
    let devices = concurrent_devices(model, a.gpus, a.concurrency)?;
    let mut done = 0u64;
    let mut round = 0u64;
    while done < u64::from(a.iterations) {
        let n = (u64::from(a.iterations) - done).min(devices.len() as u64) as usize;
        let batch: Vec<ClaimRef> = devices[..n]
            .iter()
            .enumerate()
            .map(|(j, d)| {
                put_claim(
                    &store,
                    &format!("rss-{round}-{j}"),
                    &format!("uid-rss-{round}-{j}"),
                    d,
                )
            })
            .collect::<anyhow::Result<_>>()?;
        let pid = p.pid()?;
        let prep = answered(
            pid,
            "prepare",
            n,
            futures::future::join_all(
                batch
                    .iter()
                    .map(|c| kubelet.prepare(std::slice::from_ref(c))),
            ),
        )
        .await?;
        for (c, r) in batch.iter().zip(prep) {
            let r = r?;
            let e = r
                .claims
                .get(&c.uid)
                .map_or("no result", |x| x.error.as_str());
            if !e.is_empty() {
                bail!("plugin process: prepare {c}: {e}");
            }
        }
        let unp = answered(
            pid,
            "unprepare",
            n,
            futures::future::join_all(
                batch
                    .iter()
                    .map(|c| kubelet.unprepare(std::slice::from_ref(c))),
            ),
        )
        .await?;
        for (c, r) in batch.iter().zip(unp) {
            let r = r?;
            let e = r
                .claims
                .get(&c.uid)
                .map_or("no result", |x| x.error.as_str());
            if !e.is_empty() {
                bail!("plugin process: unprepare {c}: {e}");
            }
        }
        done += n as u64;
        round += 1;
    }
    f.cycles = done;
    f.rss_after_kib = proc_rss(p.pid()?)?;
    f.rss_by_mapping = proc_rss_by_mapping(p.pid()?)?;
    f.rss_kib = f.rss_after_kib[0];
    f.hwm_kib = f.rss_after_kib[1];
    drop(kubelet);
    p.stop().await?;
    f.live_at_end = node.live_instances()?;
    api.shutdown().await;
    Ok(f)
}

/// `calls` concurrent calls to the plugin process, answered within
/// [`PROCESS_DEADLINE`] or an error that says where its threads wait.
async fn answered<T>(
    pid: u32,
    what: &str,
    calls: usize,
    f: impl std::future::Future<Output = T>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(PROCESS_DEADLINE, f).await {
        Ok(r) => Ok(r),
        Err(_) => bail!(
            "plugin process: {calls} concurrent {what} calls not all answered within {PROCESS_DEADLINE:?} (stuck?); its threads wait in: {}",
            thread_waits(pid)
        ),
    }
}

/// Kernel wait channel of each thread of a process, counted
/// (`locks_lock_inode_wait x7, do_epoll_wait x1, ...`).
fn thread_waits(pid: u32) -> String {
    let mut waits: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let dir = format!("/proc/{pid}/task");
    for t in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let w = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
        let w = if w.trim().is_empty() || w.trim() == "0" {
            "running".to_string()
        } else {
            w.trim().to_string()
        };
        *waits.entry(w).or_default() += 1;
    }
    if waits.is_empty() {
        return format!("(cannot read {dir})");
    }
    waits
        .iter()
        .map(|(w, n)| format!("{w} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Nearest-rank percentile of durations (sorted in place).
fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}

fn verdict(ok: bool) -> &'static str {
    if ok { "ok" } else { "MISSED" }
}

/// `value / target` of a lower-is-better figure.
fn ratio(value: Duration, target: Duration) -> String {
    format!(
        "{:.2}x target",
        value.as_secs_f64() / target.as_secs_f64().max(f64::MIN_POSITIVE)
    )
}

/// Verdict and ratio side by side.
fn versus(ok: bool, value: Duration, target: Duration) -> String {
    format!("{} ({})", verdict(ok), ratio(value, target))
}

fn row(out: &mut String, figure: &str, value: &str, target: &str, baseline: &str, result: &str) {
    let _ = writeln!(
        out,
        "{figure:<54} {value:>32}  {target:<16} {baseline:<34} {result}"
    );
}

/// The in-process rows, and whether every target was met.
pub(crate) fn report_in_process(a: &PrepareBench, r: &InProcess, out: &mut String) -> bool {
    let p50_p99 = |v: &mut Vec<Duration>| (pct(v, 50.0), pct(v, 99.0));
    let pair = |p: (Duration, Duration)| format!("{} / {}", ms(p.0), ms(p.1));
    let mut all_ok = true;
    let seq_total: Duration = r.prepare.iter().chain(&r.unprepare).map(|x| x.total).sum();
    for (name, v) in [("prepare", &r.prepare), ("unprepare", &r.unprepare)] {
        let t = p50_p99(&mut v.iter().map(|x| x.total).collect());
        let n = p50_p99(&mut v.iter().map(|x| x.nvml).collect());
        let f = p50_p99(&mut v.iter().map(|x| x.sync).collect());
        let o = p50_p99(&mut v.iter().map(Call::overhead).collect());
        let od = p50_p99(
            &mut v
                .iter()
                .map(|x| x.overhead().saturating_sub(x.sync))
                .collect(),
        );
        let syncs = v.iter().map(|x| x.syncs).sum::<u64>() as f64 / v.len().max(1) as f64;
        row(
            out,
            &format!("{name}: total p50 / p99 (ms)"),
            &pair(t),
            "",
            "",
            "",
        );
        row(
            out,
            &format!("{name}: inside NVML p50 / p99 (ms)"),
            &pair(n),
            "",
            "",
            "",
        );
        row(
            out,
            &format!("{name}: checkpoint fsyncs/call; their p50 / p99 (ms)"),
            &format!("{syncs:.1}; {}", pair(f)),
            "",
            "",
            "",
        );
        let ok = o.1 <= OVERHEAD_TARGET;
        all_ok &= ok;
        row(
            out,
            &format!("{name}: overhead (total - NVML) p50 / p99 (ms)"),
            &pair(o),
            "p99 <= 1 ms",
            "",
            &versus(ok, o.1, OVERHEAD_TARGET),
        );
        row(
            out,
            &format!("{name}: overhead - fsync p50 / p99 (ms)"),
            &pair(od),
            "(p99 <= 1 ms)",
            "",
            &ratio(od.1, OVERHEAD_TARGET),
        );
        let cpu: Option<Vec<Duration>> = v.iter().map(Call::cpu_overhead).collect();
        match cpu {
            Some(mut cpu) if !cpu.is_empty() => {
                let c = p50_p99(&mut cpu);
                row(
                    out,
                    &format!("{name}: CPU time - NVML p50 / p99 (ms)"),
                    &pair(c),
                    "(p99 <= 1 ms)",
                    "all threads but the stand-in's",
                    &ratio(c.1, OVERHEAD_TARGET),
                );
            }
            _ => row(
                out,
                &format!("{name}: CPU time - NVML"),
                "unavailable",
                "",
                "no per-thread CPU time from the kernel",
                "",
            ),
        }
    }
    row(
        out,
        "claim GET to the stand-in, alone, p50 / p99 (ms)",
        &pair(p50_p99(&mut r.api_get.clone())),
        "",
        "in prepare's overhead",
        "",
    );
    row(
        out,
        "status PATCH to the stand-in, alone, p50 / p99 (ms)",
        &pair(p50_p99(&mut r.api_patch.clone())),
        "",
        "background; settled before each unprepare",
        "",
    );
    row(
        out,
        "blocking-thread hand-off, empty, p50 / p99 (ms)",
        &pair(p50_p99(&mut r.hop.clone())),
        "",
        "one per NVML hop, in the overhead",
        "",
    );
    row(
        out,
        "context switches per prepare+unprepare cycle (whole process)",
        &format!("{:.1}", r.switches_per_cycle),
        "",
        "thread hand-offs, counted",
        "",
    );
    let seq_rate = if seq_total.is_zero() {
        0.0
    } else {
        r.prepare.len() as f64 / seq_total.as_secs_f64()
    };
    let rate = |wall: Duration| {
        if wall.is_zero() {
            0.0
        } else {
            r.concurrent_claims as f64 / wall.as_secs_f64()
        }
    };
    let both = r.concurrent_prepare_wall + r.concurrent_unprepare_wall;
    row(
        out,
        &format!(
            "concurrent prepare, {} at once on {} GPUs (claims/s)",
            a.concurrency, a.gpus
        ),
        &format!("{:.0}", rate(r.concurrent_prepare_wall)),
        "",
        "",
        "",
    );
    row(
        out,
        "concurrent unprepare (claims/s)",
        &format!("{:.0}", rate(r.concurrent_unprepare_wall)),
        "",
        "",
        "",
    );
    row(
        out,
        "concurrent prepare+unprepare cycles (claims/s)",
        &format!("{:.0}", rate(both)),
        "",
        &format!("one at a time: {seq_rate:.0} claims/s"),
        "",
    );
    let prepares = r.prepares_ok;
    let unprepares = r.unprepares_ok;
    let counts_ok = r.counts.gi_created == prepares
        && r.counts.ci_created == prepares
        && r.counts.gi_destroyed == unprepares
        && r.counts.ci_destroyed == unprepares
        && r.live_at_end == 0
        && r.cdi_left == 0;
    all_ok &= counts_ok;
    row(
        out,
        "GI/CI created, destroyed; live; CDI left",
        &format!(
            "{}/{}, {}/{}; {}; {}",
            r.counts.gi_created,
            r.counts.ci_created,
            r.counts.gi_destroyed,
            r.counts.ci_destroyed,
            r.live_at_end,
            r.cdi_left
        ),
        &format!("{prepares}, {unprepares}; 0; 0"),
        "",
        verdict(counts_ok),
    );
    all_ok
}

fn report_process(a: &PrepareBench, f: &ProcessFigures, out: &mut String) -> bool {
    let target = RSS_TARGET_BYTES as f64 / 1e6;
    let base = format!(
        "NVIDIA Go plugin --help: {:.0} MB",
        NVIDIA_HELP_RSS_BYTES as f64 / 1e6
    );
    let rss_ok = mb(f.rss_kib) * 1e6 <= RSS_TARGET_BYTES as f64;
    let hwm_ok = mb(f.hwm_kib) * 1e6 <= RSS_TARGET_BYTES as f64;
    let split = |k: [u64; 4]| {
        format!(
            "{:.1} (anon {:.1}, file {:.1})",
            mb(k[0]),
            mb(k[2]),
            mb(k[3])
        )
    };
    row(
        out,
        "plugin VmRSS registered, idle (MB)",
        &split(f.rss_idle_kib),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin VmRSS after {} claims (MB)", f.cycles),
        &split(f.rss_after_kib),
        &format!("<= {target:.0} MB"),
        &base,
        &format!(
            "{} ({:.2}x target)",
            verdict(rss_ok),
            mb(f.rss_kib) * 1e6 / RSS_TARGET_BYTES as f64
        ),
    );
    let top = |by: &[(String, u64)]| {
        by.iter()
            .take(6)
            .map(|(name, kib)| format!("{name} {:.1}", mb(*kib)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    row(
        out,
        "plugin RSS by mapping registered, idle (MB)",
        &top(&f.rss_idle_by_mapping),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin RSS by mapping after {} claims (MB)", f.cycles),
        &top(&f.rss_by_mapping),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin VmHWM after {} claims (MB)", f.cycles),
        &format!("{:.1}", mb(f.hwm_kib)),
        &format!("<= {target:.0} MB"),
        &base,
        &format!(
            "{} ({:.2}x target)",
            verdict(hwm_ok),
            mb(f.hwm_kib) * 1e6 / RSS_TARGET_BYTES as f64
        ),
    );
    row(
        out,
        "carve --help peak RSS (MB, upper bound, see docs)",
        &format!("{:.1}", mb(f.help_peak_kib)),
        "",
        &base,
        "",
    );
    let mut s = f.starts.clone();
    let p50 = pct(&mut s, 50.0);
    let max = s.iter().copied().max().unwrap_or_default();
    let start_ok = max <= START_TARGET;
    row(
        out,
        &format!(
            "start -> GetInfo answered, {} starts p50 / max (ms)",
            f.starts.len()
        ),
        &format!("{} / {}", ms(p50), ms(max)),
        "max <= 1 s",
        "",
        &versus(start_ok, max, START_TARGET),
    );
    let live_ok = f.live_at_end == 0;
    row(
        out,
        "plugin process: GPU instances left",
        &f.live_at_end.to_string(),
        "0",
        "",
        verdict(live_ok),
    );
    let _ = a;
    rss_ok && hwm_ok && start_ok && live_ok
}

pub fn run(args: &PrepareBench) -> anyhow::Result<std::process::ExitCode> {
    if std::env::var_os(nvidia_ml_sim::CONFIG_ENV).is_some() {
        bail!(
            "{} is set: the simulator would use that configuration instead of the benchmark's; unset it",
            nvidia_ml_sim::CONFIG_ENV
        );
    }
    let model = check_args(args)?;
    let lib = crate::simulate::find_sim_lib(args.nvml_sim_lib.as_deref())?;
    let help_kib = if args.skip_rss {
        0
    } else {
        help_peak_kib(&std::env::current_exe().context("locating this executable")?)?
    };
    // The driver runs on the plugin's runtime; the stand-in on its own.
    let rt = crate::plugin::runtime()?;
    let stand_in = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(STAND_IN_THREAD)
        .enable_all()
        .build()?;
    println!(
        "carve bench prepare: {} x {} (NVML simulator {}, simulator state in {}, plugin files in {}, CDI specs in {}, {}, plugin process with MALLOC_ARENA_MAX={MALLOC_ARENA_MAX} as the chart; GPUs start in MIG mode, and the plugin fsyncs a checkpoint write only when it records MIG mode the plugin enabled), {} iterations, build {}",
        args.gpus,
        model.key,
        lib.display(),
        sim_parent().display(),
        args.files_dir.display(),
        args.cdi_dir().display(),
        if args.without_pod_uid {
            "no pod UID (unlike the chart)"
        } else {
            "with a pod UID as the chart"
        },
        args.iterations,
        if cfg!(debug_assertions) {
            "debug (figures are pessimistic; use --release)"
        } else {
            "release"
        }
    );
    let mut out = String::new();
    row(&mut out, "figure", "value", "target", "baseline", "result");
    let r = rt
        .block_on(in_process(args, model, &lib, stand_in.handle()))
        .context("in-process part")?;
    let mut ok = report_in_process(args, &r, &mut out);
    print!("{out}");
    out.clear();
    if !args.skip_rss {
        let f = rt
            .block_on(plugin_process(args, model, &lib, help_kib))
            .context("plugin-process part (RSS, time to registration; --skip-rss skips it)")?;
        ok &= report_process(args, &f, &mut out);
        print!("{out}");
    }
    Ok(if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(iterations: u32, gpus: u32, concurrency: u32) -> PrepareBench {
        PrepareBench {
            iterations,
            gpus,
            concurrency,
            model: "h100-80gb".into(),
            skip_rss: true,
            nvml_sim_lib: None,
            files_dir: std::env::temp_dir(),
            cdi_dir: None,
            without_pod_uid: false,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_prepare_creates_one_instance_and_every_unprepare_destroys_it() {
        let a = args(12, 2, 14);
        let model = check_args(&a).unwrap();
        let lib = crate::simulate::find_sim_lib(None).unwrap();
        let r = in_process(&a, model, &lib, &tokio::runtime::Handle::current())
            .await
            .unwrap();
        assert_eq!(r.prepare.len(), 12);
        assert_eq!(r.unprepare.len(), 12);
        // 12 one at a time, then max(1, 12 / 14) = 1 round of 14.
        assert_eq!(r.concurrent_claims, 14);
        assert_eq!(r.prepares_ok, 26);
        assert_eq!(r.unprepares_ok, 26);
        assert_eq!(r.counts.gi_created, 26);
        assert_eq!(r.counts.ci_created, 26);
        assert_eq!(r.counts.gi_destroyed, 26);
        assert_eq!(r.counts.ci_destroyed, 26);
        assert_eq!(r.live_at_end, 0);
        assert_eq!(r.cdi_left, 0);
        // NVML time is part of each call's total. The simulated GPUs start
        // in MIG mode, so no checkpoint write records MIG mode the plugin
        // enabled and none is fsynced (the fsync counter is process-wide, so
        // other tests' writes could add to it: nothing is asserted on it).
        assert!(
            r.prepare
                .iter()
                .chain(&r.unprepare)
                .all(|c| c.nvml <= c.total && !c.nvml.is_zero())
        );
        // Every call used CPU outside NVML (its checkpoint write at least),
        // and the report has the rows.
        assert!(
            r.prepare
                .iter()
                .chain(&r.unprepare)
                .all(|c| c.cpu.is_some_and(|x| x > c.nvml_cpu))
        );
        assert_eq!(r.api_get.len(), API_SAMPLES);
        assert_eq!(r.api_patch.len(), API_SAMPLES);
        assert_eq!(r.hop.len(), API_SAMPLES);
        let mut out = String::new();
        assert!(report_in_process(&a, &r, &mut out) || out.contains("MISSED"));
        assert!(out.contains("26/26, 26/26; 0; 0"), "{out}");
        assert!(
            out.contains("prepare: CPU time - NVML p50 / p99 (ms)"),
            "{out}"
        );
    }

    /// A thread that used `cpu` of CPU time, then sleeps until `release`
    /// drops; reports its thread id.
    fn busy_thread(
        name: &str,
        cpu: Duration,
        release: std::sync::mpsc::Receiver<()>,
    ) -> (i32, std::thread::JoinHandle<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while ThreadCpu::own().unwrap() < cpu {
                    std::hint::black_box((0..1000u64).sum::<u64>());
                }
                tx.send(nix::unistd::gettid().as_raw()).unwrap();
                let _ = release.recv();
            })
            .unwrap();
        (rx.recv().unwrap(), h)
    }

    #[test]
    fn thread_cpu_counts_the_other_threads_but_the_skipped_ones() {
        // This thread's clock read through the per-thread encoding agrees
        // with CLOCK_THREAD_CPUTIME_ID.
        let me = nix::unistd::gettid().as_raw();
        let a = ThreadCpu::own().unwrap();
        let b = ThreadCpu::clock(ThreadCpu::thread_clock(me)).unwrap();
        let c = ThreadCpu::own().unwrap();
        assert!(a <= b && b <= c, "{a:?} {b:?} {c:?}");
        let before = ThreadCpu::before("skipped").unwrap();
        let (stop_a, ra) = std::sync::mpsc::channel();
        let (stop_b, rb) = std::sync::mpsc::channel();
        let (counted, ha) = busy_thread("counted", Duration::from_millis(40), ra);
        let (skipped, hb) = busy_thread("skipped", Duration::from_millis(40), rb);
        let others = ThreadCpu::others("skipped").unwrap();
        assert!(!others.contains_key(&skipped));
        assert!(!others.contains_key(&nix::unistd::gettid().as_raw()));
        assert!(others[&counted] >= 40_000_000, "{others:?}");
        // The counted thread is new since `before`: all its time counts.
        assert!(before.since("skipped").unwrap() >= Duration::from_millis(40));
        drop((stop_a, stop_b));
        ha.join().unwrap();
        hb.join().unwrap();
    }

    #[test]
    fn bad_flags_are_named() {
        let e = check_args(&args(10, 8, 57)).unwrap_err().to_string();
        assert!(
            e.contains("--concurrency 57") && e.contains("1..=56") && e.contains("1g.10gb"),
            "{e}"
        );
        let e = check_args(&args(10, 1, 0)).unwrap_err().to_string();
        assert!(e.contains("--concurrency 0"), "{e}");
        let e = check_args(&args(0, 1, 1)).unwrap_err().to_string();
        assert!(e.contains("--iterations"), "{e}");
        let mut a = args(1, 1, 1);
        a.model = "v100".into();
        let e = check_args(&a).unwrap_err().to_string();
        assert!(e.contains("v100") && e.contains("h100-80gb"), "{e}");
        let e = crate::simulate::find_sim_lib(Some(Path::new("/nonexistent/lib.so")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/lib.so"), "{e}");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(pct(&mut v, 50.0), Duration::from_millis(50));
        assert_eq!(pct(&mut v, 99.0), Duration::from_millis(99));
        assert_eq!(
            pct(&mut [Duration::from_millis(7)], 99.0),
            Duration::from_millis(7)
        );
    }
}
