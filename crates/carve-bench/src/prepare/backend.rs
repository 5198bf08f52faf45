//! The NVML backend under the driver, timed: what the driver's calls spend
//! inside NVML is measured, to be subtracted from their wall time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use carve_gpu::{
    BackendError, ComputeInstanceInfo, ComputeMode, ComputeTarget, GpuBackend, GpuInfo,
    GpuInstanceInfo, MigMode,
};
use carve_model::{MigProfile, Placement};

use super::cpu::ThreadCpu;

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
