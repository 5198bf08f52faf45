//! The CUDA MPS side of carve's GPU sharing: detect what the node's MPS and
//! cgroup setup enforce ([`detect`]), supervise one `nvidia-cuda-mps-control`
//! daemon per shared whole GPU or MIG instance ([`MpsControl`]: start with its
//! own pipe and log directories, adopt across plugin restarts, restart and
//! re-apply limits after a crash, `quit` after the last claim), turn each
//! claim share's limits into v2 commands or a v3 namespace of its own, and
//! describe the share's container edits ([`ShareEdits`]: in v3 only the
//! namespace's pipe directory, and the unit's `/dev/shm` tmpfs, [`shm`]),
//! each daemon in a cgroup and session of its own outside the plugin's so
//! that it outlives the plugin's container ([`daemon_cgroup`], [`launcher`]).
//!
//! Not here: the device descriptions and `consumedCapacity` translation
//! (`carve_model::sharing`), writing CDI files, GPU compute mode (NVML), MIG
//! instance creation and the checkpoint (`carve-plugin`). Blocking code; call
//! it from `spawn_blocking`.
//!
//! [`fake`] stands in for `nvidia-cuda-mps-control` in tests and `carve
//! simulate` (as the `carve-fake-mps-control` binary of this crate, or the
//! `carve` binary run through a link of that name): written from NVIDIA's
//! documentation (`../shared/reference/mps-v3.md`), it rejects what the real
//! daemon rejects, models per-server and per-namespace sockets, UID routing
//! and servers that never become `Ready`, records what it gets, and crashes
//! on request. [`fake_smi`] stands in for `nvidia-smi memory-limits`, with
//! a cgroup fixture that has `dmem.*` files only where the parent enables
//! `+dmem`; [`memlimit`] sets, reads back and clears hard memory limits
//! through the real or the fake tool.

pub mod cdi;
pub mod cgroup;
pub mod control;
pub mod daemon_cgroup;
pub mod detect;
pub mod error;
pub mod fake;
pub mod fake_smi;
pub mod launcher;
pub mod memlimit;
mod proc;
pub mod shm;

pub use cdi::{CONTAINER_PIPE_DIR, Mount, ShareEdits, share_cdi_name};
pub use cgroup::pod_cgroup;
pub use control::{ClientSpec, DaemonIdentity, Ensure, MpsControl, MpsTarget, PID_FILE, Protocol};
pub use detect::{MpsConfig, ProtocolChoice, Support, detect, detect_cgroup};
pub use error::MpsError;
