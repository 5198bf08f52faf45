//! The plugin's side of `carve-metrics`: a [`GpuBackend`] wrapper that times
//! every NVML-shaped call under its NVML symbol, and the mapping of
//! [`ClaimError`] onto the bounded [`FailureReason`] label.

use std::sync::Arc;

use carve_gpu::{
    BackendError, ComputeInstanceInfo, ComputeMode, ComputeTarget, GpuBackend, GpuInfo,
    GpuInstanceInfo, MigMode,
};
use carve_metrics::{FailureReason, Metrics};
use carve_model::{MigProfile, Placement};

use crate::driver::ClaimError;

/// The `reason` label of a failed prepare or unprepare.
#[must_use]
pub fn failure_reason(e: &ClaimError) -> FailureReason {
    match e {
        ClaimError::Invalid(_)
        | ClaimError::Replaced { .. }
        | ClaimError::NotAllocated
        | ClaimError::OtherPool { .. }
        | ClaimError::BadDeviceName(_)
        | ClaimError::MpsDisabled { .. }
        | ClaimError::BadShare { .. }
        | ClaimError::Sharing { .. }
        | ClaimError::NoSuchGpu { .. }
        | ClaimError::NotMigCapable { .. }
        | ClaimError::NoSuchProfile { .. }
        | ClaimError::BadPlacement { .. }
        | ClaimError::Config(_) => FailureReason::InvalidClaim,
        ClaimError::NotFound { .. } => FailureReason::ClaimNotFound,
        ClaimError::Occupied { .. }
        | ClaimError::GpuHeld { .. }
        | ClaimError::GpuHasInstances { .. }
        | ClaimError::StaticMissing { .. }
        | ClaimError::MigPending { .. }
        | ClaimError::WholeInMigMode { .. } => FailureReason::PlacementUnavailable,
        ClaimError::Backend { .. } | ClaimError::Busy { .. } => FailureReason::Nvml,
        ClaimError::Kube { .. } => FailureReason::KubeApi,
        ClaimError::Checkpoint(_) => FailureReason::Checkpoint,
        ClaimError::Mps { .. }
        | ClaimError::NoPodCgroup { .. }
        | ClaimError::MemoryLimit { .. } => FailureReason::Mps,
        ClaimError::Cdi(_) | ClaimError::Driver(_) => FailureReason::Cdi,
        ClaimError::Task(_) => FailureReason::Internal,
    }
}

/// A backend that records each call's latency as
/// `carve_nvml_call_duration_seconds{function=<NVML symbol>}` and passes it on.
#[derive(Debug)]
pub(crate) struct TimedBackend {
    inner: Arc<dyn GpuBackend>,
    metrics: Arc<Metrics>,
}

impl TimedBackend {
    pub(crate) fn wrap(inner: Arc<dyn GpuBackend>, metrics: Arc<Metrics>) -> Arc<dyn GpuBackend> {
        Arc::new(Self { inner, metrics })
    }
}

impl GpuBackend for TimedBackend {
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.metrics
            .time_nvml("nvmlDeviceGetCount_v2", || self.inner.gpus())
    }

    fn profiles(&self, gpu: u32) -> Result<Vec<MigProfile>, BackendError> {
        self.metrics
            .time_nvml("nvmlDeviceGetGpuInstanceProfileInfo", || {
                self.inner.profiles(gpu)
            })
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        self.metrics
            .time_nvml("nvmlDeviceGetMigMode", || self.inner.mig_mode(gpu))
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigMode, BackendError> {
        self.metrics.time_nvml("nvmlDeviceSetMigMode", || {
            self.inner.set_mig_mode(gpu, enabled)
        })
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceInfo>, BackendError> {
        self.metrics.time_nvml("nvmlDeviceGetGpuInstances", || {
            self.inner.gpu_instances(gpu)
        })
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: Placement,
    ) -> Result<GpuInstanceInfo, BackendError> {
        self.metrics
            .time_nvml("nvmlDeviceCreateGpuInstanceWithPlacement", || {
                self.inner.create_gpu_instance(gpu, profile_id, placement)
            })
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<ComputeInstanceInfo, BackendError> {
        self.metrics
            .time_nvml("nvmlGpuInstanceCreateComputeInstance", || {
                self.inner.create_compute_instance(gpu, gi)
            })
    }

    fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError> {
        self.metrics.time_nvml("nvmlComputeInstanceDestroy", || {
            self.inner.destroy_compute_instance(gpu, gi, ci)
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        self.metrics.time_nvml("nvmlGpuInstanceDestroy", || {
            self.inner.destroy_gpu_instance(gpu, gi)
        })
    }

    fn capability_minor(
        &self,
        gpu_minor: u32,
        gi: u32,
        ci: Option<u32>,
    ) -> Result<u32, BackendError> {
        // A procfs read, not an NVML call: not timed.
        self.inner.capability_minor(gpu_minor, gi, ci)
    }

    fn compute_mode(&self, target: ComputeTarget) -> Result<ComputeMode, BackendError> {
        self.metrics.time_nvml("nvmlDeviceGetComputeMode", || {
            self.inner.compute_mode(target)
        })
    }

    fn set_compute_mode(
        &self,
        target: ComputeTarget,
        mode: ComputeMode,
    ) -> Result<(), BackendError> {
        self.metrics.time_nvml("nvmlDeviceSetComputeMode", || {
            self.inner.set_compute_mode(target, mode)
        })
    }
}
