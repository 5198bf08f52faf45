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
//!
//! The API: check the [`Options`] ([`check`]), run the [`in_process`] part
//! on a runtime like the plugin's with the stand-in on
//! [`stand_in_runtime`], then, optionally, the [`plugin_process`] part
//! (after [`help_peak_kib`], run first while this process is small); each
//! part's figures make a [`Report`] of table rows under [`table_header`],
//! below the [`title`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_model::GpuModel;

use crate::BenchError;

mod backend;
mod cpu;
mod in_process;
mod node;
mod process;
mod report;

pub use in_process::{InProcess, in_process};
pub use process::{ProcessFigures, help_peak_kib, plugin_process};
pub use report::{Report, table_header};

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

/// What to measure: the flags of `carve bench prepare`, which the error
/// messages name.
#[derive(Debug, Clone)]
pub struct Options {
    /// Prepare+unprepare cycles: timed one at a time, then again
    /// concurrently, and driven through the plugin process for its RSS.
    pub iterations: u32,
    /// Simulated GPUs on the node.
    pub gpus: u32,
    /// Claims prepared at once in the throughput run (at most one per
    /// smallest-profile placement of the node).
    pub concurrency: u32,
    /// GPU model of the simulated node (MIG-capable).
    pub model: String,
    /// Where the plugin's files go (checkpoint, sockets).
    pub files_dir: PathBuf,
    /// Where the CDI specs go; `None`: a tmpfs where the host has one.
    pub cdi_dir: Option<PathBuf>,
    /// Run without a pod UID (no host lock, no checkpoint reread per
    /// operation), unlike the Helm chart.
    pub without_pod_uid: bool,
}

impl Options {
    /// `cdi_dir`, or a tmpfs where the host has one.
    fn cdi_dir(&self) -> PathBuf {
        self.cdi_dir.clone().unwrap_or_else(sim_parent)
    }
}

/// The model to simulate, once the options are checked: at least one
/// iteration and one GPU, a known MIG-capable model, a concurrency that fits
/// its smallest profile's placements. Also refuses to run when the
/// simulator's configuration variable is set, since the simulator would use
/// that configuration instead of the benchmark's.
pub fn check(a: &Options) -> Result<&'static GpuModel, BenchError> {
    if std::env::var_os(nvidia_ml_sim::CONFIG_ENV).is_some() {
        return Err(BenchError::Options(format!(
            "{} is set: the simulator would use that configuration instead of the benchmark's; unset it",
            nvidia_ml_sim::CONFIG_ENV
        )));
    }
    check_flags(a)
}

fn check_flags(a: &Options) -> Result<&'static GpuModel, BenchError> {
    if a.iterations == 0 {
        return Err(BenchError::Options(
            "--iterations must be at least 1".into(),
        ));
    }
    if a.gpus == 0 {
        return Err(BenchError::Options("--gpus must be at least 1".into()));
    }
    let model = GpuModel::find(&a.model).ok_or_else(|| {
        BenchError::Options(format!(
            "--model {:?}: unknown GPU model; known: {}",
            a.model,
            GpuModel::keys().join(", ")
        ))
    })?;
    if model.spec().profiles.is_empty() {
        return Err(BenchError::Options(format!(
            "--model {}: not MIG-capable",
            model.key
        )));
    }
    node::concurrent_devices(model, a.gpus, a.concurrency)?;
    Ok(model)
}

/// The runtime the API-server stand-in serves from: one worker thread of its
/// own, as an API server elsewhere would be, named so that its CPU time is
/// left out of the driver's.
pub fn stand_in_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(STAND_IN_THREAD)
        .enable_all()
        .build()
}

/// The first line of the output: the node, where its files go, how the
/// plugin runs, the build.
pub fn title(a: &Options, model: &GpuModel, lib: &Path) -> String {
    format!(
        "carve bench prepare: {} x {} (NVML simulator {}, simulator state in {}, plugin files in {}, CDI specs in {}, {}, plugin process with MALLOC_ARENA_MAX={MALLOC_ARENA_MAX} as the chart; GPUs start in MIG mode, and the plugin fsyncs a checkpoint write only when it records MIG mode the plugin enabled), {} iterations, build {}",
        a.gpus,
        model.key,
        lib.display(),
        sim_parent().display(),
        a.files_dir.display(),
        a.cdi_dir().display(),
        if a.without_pod_uid {
            "no pod UID (unlike the chart)"
        } else {
            "with a pod UID as the chart"
        },
        a.iterations,
        if cfg!(debug_assertions) {
            "debug (figures are pessimistic; use --release)"
        } else {
            "release"
        }
    )
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn options(iterations: u32, gpus: u32, concurrency: u32) -> Options {
        Options {
            iterations,
            gpus,
            concurrency,
            model: "h100-80gb".into(),
            files_dir: std::env::temp_dir(),
            cdi_dir: None,
            without_pod_uid: false,
        }
    }

    /// The NVML simulator library cargo builds next to this test executable
    /// (in `deps/`, or one directory up).
    pub(crate) fn sim_lib() -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap();
        [
            dir.join("libnvidia_ml_sim.so"),
            dir.join("../libnvidia_ml_sim.so"),
        ]
        .into_iter()
        .find(|p| p.is_file())
        .expect(
            "libnvidia_ml_sim.so next to the test executable: cargo builds it with carve-nvml-sim",
        )
    }

    #[test]
    fn bad_flags_are_named() {
        let e = check_flags(&options(10, 8, 57)).unwrap_err().to_string();
        assert!(
            e.contains("--concurrency 57") && e.contains("1..=56") && e.contains("1g.10gb"),
            "{e}"
        );
        let e = check_flags(&options(10, 1, 0)).unwrap_err().to_string();
        assert!(e.contains("--concurrency 0"), "{e}");
        let e = check_flags(&options(0, 1, 1)).unwrap_err().to_string();
        assert!(e.contains("--iterations"), "{e}");
        let mut a = options(1, 1, 1);
        a.model = "v100".into();
        let e = check_flags(&a).unwrap_err().to_string();
        assert!(e.contains("v100") && e.contains("h100-80gb"), "{e}");
    }
}
