//! The carve kubelet plugin: registers with kubelet over the plugin-registration
//! socket, serves the DRA `DRAPlugin` service (v1 and v1beta1) on `dra.sock`, and
//! prepares claims by creating MIG GPU/compute instances at the exact placement
//! the scheduler allocated, writing one transient CDI spec per claim and a
//! crash-safe checkpoint. At start it converges from NVML truth (see
//! [`Driver::recover`]).
//!
//! With a pod UID configured (rolling update) two plugin pods may serve at
//! once; each operation then holds an exclusive lock on `<checkpoint>.lock` and
//! reloads the checkpoint first (parsing it only when another process wrote
//! it), so the pods share one state.
//!
//! The sockets, registration and gRPC services are the
//! [`dra_kubeletplugin`] kit's; carve's [`Driver`] is served through it
//! (`kit.rs`), with the GPU health stream from a [`health::HealthMonitor`]
//! when one is attached ([`health::serve_with`]).
//!
//! It is not the ResourceSlice publisher (`carve-kube`) and not an NVML
//! binding (`carve-nvml`). MPS devices are rejected per claim unless MPS is
//! enabled on the node ([`PluginConfig::mps`]). Time-slice devices
//! (`gpu-<i>-ts`) are handed out as the whole GPU to every sharing claim,
//! under the driver's default time-slicing scheduler: NVML offers no
//! bare-metal time-slice policy carve could set.

mod api;
mod cdi;
mod checkpoint;
mod claim;
mod config;
mod driver;
mod driver_root;
mod error;
mod fsutil;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod health;
mod kit;
mod metrics;
mod mps;
mod server;
#[cfg(feature = "testing")]
pub mod testing;

pub use api::ApiFailure;
pub use cdi::{
    CDI_KIND, CdiDevice, CdiError, CdiSpec, ContainerEdits as CdiContainerEdits,
    DeviceNode as CdiDeviceNode, Hook as CdiHook, Mount as CdiMount, claim_spec_path,
};
pub use checkpoint::{
    CHECKPOINT_API_VERSION, Checkpoint, CheckpointBody, CheckpointError, ClaimRecord, ClaimState,
    DeviceRecord, MpsShare, PreparedKind,
};
pub use claim::{
    ClaimRef, FieldProblem, InvalidClaim, MAX_NAME_LEN, MAX_NAMESPACE_LEN, MAX_UID_LEN,
    PreparedDevice, ReadClaim,
};
pub use config::{
    ConfigError, DriverCapability, GpuConfig, GpuPolicy, MigConfig, MpsSetup, OPAQUE_API_VERSION,
    OpaqueConfig, PluginConfig, Retry, WriteFault,
};
pub use driver::{API_CONCURRENCY, ClaimError, Driver, RecoveryReport, STATUS_SETTLE};
pub use driver_root::{
    DriverFiles, DriverRootConfig, DriverRootError, caps_major, discover, find_nvml,
};
pub use error::PluginError;
pub use metrics::failure_reason;
pub use server::{Registration, Serving, SocketPaths, run, serve};
