//! An NVML simulator: a `cdylib` (`libnvidia_ml_sim.so`) exporting the NVML C
//! ABI for the functions carve uses, backed by the GPU models of `carve-model`,
//! plus (as an rlib) the helpers tests use to configure it.
//!
//! It simulates hardware semantics, not a permissive fake: overlapping or
//! exhausted placements fail with `NVML_ERROR_INSUFFICIENT_RESOURCES`, GPU
//! instance operations need MIG mode, MIG mode changes are pending until a
//! reset on Ampere ([`simulate_gpu_reset`], which also drops the instances as
//! a real reset does), compute mode needs a MIG device handle in MIG mode, destroying a GPU instance with
//! compute instances fails with `NVML_ERROR_IN_USE`, and MIG capability files
//! are written under a fake `/proc/driver/nvidia`.
//!
//! Configuration: the JSON file named by `CARVE_NVML_SIM_CONFIG`, else the
//! side-car `<library path>.json` next to the loaded library (so one process can
//! load several copies with different configurations). See [`SimConfig`].
//! State is persisted atomically to the state file after every mutation and
//! reloaded at `nvmlInit`. Faults come from the configuration and from the
//! JSON array in `CARVE_NVML_SIM_FAULTS`. One process at a time may use one state file: there
//! is a process-wide lock but no file lock.
//!
//! Events: `nvmlEventSetCreate`/`nvmlDeviceRegisterEvents`/`nvmlEventSetWait_v2`
//! deliver XID and ECC events that tests append with [`inject_event`] to
//! [`SimConfig::events_file`]; an event set sees only events injected after it
//! was created. GPUs listed in `eventsUnsupported` do not support events.
//!
//! [`driver_root`] writes a fake NVIDIA driver root and `/proc/devices` for a
//! simulated node (what the kubelet plugin's CDI specs mount into containers).
//!
//! It is not NVML: no telemetry, no processes, no vGPU, no real UUIDs.

mod config;
pub mod driver_root;
mod events;
mod ffi;
mod sim;
mod state;

pub use config::{
    CONFIG_ENV, CorruptProfile, FAULTS_ENV, Fault, FaultAction, GpuEntry, SIDECAR_SUFFIX,
    SimConfig, SimError, write_atomic,
};
pub use events::{SUPPORTED_EVENT_TYPES, SimEvent, inject_event, read_events};
pub use state::{CiState, GiState, GpuState, SimState, simulate_gpu_reset};

/// Every NVML symbol the library exports.
pub const EXPORTED_SYMBOLS: &[&str] = &[
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetAttributes_v2",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceSetComputeMode",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceSetMigMode",
    "nvmlDeviceGetGpuInstanceProfileInfoV",
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
    "nvmlDeviceGetGpuInstanceRemainingCapacity",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceDestroy",
    "nvmlDeviceGetGpuInstances",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlComputeInstanceDestroy",
    "nvmlGpuInstanceGetComputeInstances",
    "nvmlGpuInstanceGetComputeInstanceById",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
];
