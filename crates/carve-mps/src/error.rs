//! Errors of the MPS supervisor. Each names the unit (shared device), claim,
//! file or command it is about.

use std::path::PathBuf;

use carve_model::sharing::SharingError;

/// Why an MPS operation failed. Whatever failed left no daemon behind that no
/// claim needs, and did not change other claims' limits.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// The control binary does not exist or is not executable: MPS is not installed.
    #[error("MPS is not installed: control binary {path} {why}")]
    NotInstalled {
        /// Configured path of `nvidia-cuda-mps-control`.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A file or directory operation failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A state file does not parse.
    #[error("MPS state file {path} is corrupt")]
    State {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// Starting the control daemon failed.
    #[error("{unit}: starting {binary} {args} failed: {why}")]
    StartFailed {
        /// Shared device.
        unit: String,
        /// The control binary.
        binary: PathBuf,
        /// Its arguments.
        args: String,
        /// Exit status and stderr, or the spawn error.
        why: String,
    },
    /// The daemon did not become ready (pid file and control pipe) in time.
    #[error("{unit}: control daemon not ready in {pipe_dir} after {waited_ms} ms")]
    NotReady {
        /// Shared device.
        unit: String,
        /// Its pipe directory.
        pipe_dir: PathBuf,
        /// How long carve waited.
        waited_ms: u128,
    },
    /// A control command failed or timed out.
    #[error("{unit}: MPS command {command:?} failed: {why}")]
    Command {
        /// Shared device.
        unit: String,
        /// The command (stdin text or verb arguments).
        command: String,
        /// Exit status and output, or the timeout.
        why: String,
    },
    /// The daemon did not exit after `quit`.
    #[error("{unit}: control daemon pid {pid} still runs after quit")]
    StopTimeout {
        /// Shared device.
        unit: String,
        /// Its pid.
        pid: u32,
    },
    /// The unit's daemon cgroup ([`crate::daemon_cgroup`]) cannot be found,
    /// made or removed.
    #[error("{unit}: {op} {path}")]
    DaemonCgroup {
        /// Shared device.
        unit: String,
        /// What was being done.
        op: &'static str,
        /// The cgroup directory (or the cgroup root).
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The configured daemon cgroup is not a relative path of plain names.
    #[error(
        "MPS daemon cgroup {path:?} must be a relative path below the cgroup root, without `.` or `..`"
    )]
    BadCgroupDir {
        /// As configured.
        path: PathBuf,
    },
    /// The configuration asks for what this node cannot do.
    #[error("MPS strategy {wanted} is not supported here: {why}")]
    StrategyUnsupported {
        /// What was asked for.
        wanted: String,
        /// What is missing.
        why: String,
    },
    /// v3: the control daemon's server is not `Ready` (a `server create` can
    /// succeed and leave no server; clients would then run without MPS).
    #[error("{unit}: MPS server {server} is not Ready (status: {status}); server.log: {log}")]
    ServerNotReady {
        /// Shared device.
        unit: String,
        /// The server name.
        server: String,
        /// Its status, or why it is not listed.
        status: String,
        /// The last lines of its `server.log`, if any.
        log: String,
    },
    /// The same claim and share were added before with other limits.
    #[error("{unit}: claim {claim} share {share} is already a client with other limits")]
    ShareConflict {
        /// Shared device.
        unit: String,
        /// Claim UID.
        claim: String,
        /// Share ID.
        share: String,
    },
    /// A second claim on a unit whose daemon speaks v2: its pipe directory,
    /// which every client needs, is the daemon's control endpoint, so a v2
    /// unit serves one claim ([`crate::control`]).
    #[error(
        "{unit}: claim {claim} refused: the unit's MPS control daemon speaks protocol v2 and already serves claim {holder}; under v2 every client reaches the daemon's control endpoint (quit, set_active_thread_percentage, set_device_pinned_mem_limit), so carve gives a v2 unit to one claim at a time (its pods may share it); use MPS v3 (driver r615 or later) for several claims on one unit"
    )]
    V2UnitTaken {
        /// Shared device.
        unit: String,
        /// The refused claim.
        claim: String,
        /// The claim the unit serves.
        holder: String,
    },
    /// A claim or share id cannot be used in names and paths.
    #[error("{what} {value:?} is not a valid id (want 1-64 of [A-Za-z0-9_.-])")]
    BadId {
        /// `claim` or `share`.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// The allocation cannot be translated into limits.
    #[error("claim {claim} share {share}")]
    Translate {
        /// Claim UID.
        claim: String,
        /// Share ID.
        share: String,
        /// Why (boxed: it is large).
        #[source]
        source: Box<SharingError>,
    },
}

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> MpsError {
    let path = path.into();
    move |source| MpsError::Io { op, path, source }
}
