//! Plugin-level errors and their single mapping to gRPC status.

use std::path::PathBuf;

use crate::cdi::CdiError;
use crate::checkpoint::CheckpointError;

/// A failure of the plugin as a whole (start-up, sockets, recovery), as opposed
/// to a per-claim failure ([`crate::ClaimError`]), which goes into the claim's
/// `error` field.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// A directory or file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The GPU inventory could not be read at start.
    #[error("GPU inventory: {op}: {source}")]
    Backend {
        /// The operation.
        op: String,
        /// The backend error.
        #[source]
        source: carve_gpu::BackendError,
    },
    /// The API server failed, or did not answer within
    /// [`crate::PluginConfig::api_timeout`], during recovery.
    #[error("API server: {what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: Box<crate::api::ApiFailure>,
    },
    /// The checkpoint could not be written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A CDI spec could not be written or removed.
    #[error(transparent)]
    Cdi(#[from] CdiError),
    /// Recovery could not destroy an orphaned instance.
    #[error("recovery: orphan sweep: {source}")]
    Sweep {
        /// The failure.
        #[source]
        source: Box<crate::driver::ClaimError>,
    },
    /// Recovery could not bring the MPS daemons in line with the checkpoint.
    #[error("recovery: MPS daemons: {source}")]
    MpsRecovery {
        /// The failure.
        #[source]
        source: Box<crate::driver::ClaimError>,
    },
    /// The kubelet-plugin kit (sockets, gRPC servers) failed.
    #[error(transparent)]
    Kit(Box<dra_kubeletplugin::Error>),
    /// A blocking task panicked or was cancelled.
    #[error("blocking task {what}: {reason}")]
    Task {
        /// What the task did.
        what: &'static str,
        /// The join error.
        reason: String,
    },
}

impl From<PluginError> for tonic::Status {
    fn from(e: PluginError) -> Self {
        let msg = e.to_string();
        match e {
            PluginError::Kube { .. } | PluginError::Backend { .. } => Self::unavailable(msg),
            PluginError::Io { .. }
            | PluginError::Sweep { .. }
            | PluginError::MpsRecovery { .. }
            | PluginError::Checkpoint(_)
            | PluginError::Cdi(_)
            | PluginError::Kit(_)
            | PluginError::Task { .. } => Self::internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes() {
        let io = PluginError::Io {
            what: "binding socket",
            path: "/x.sock".into(),
            source: std::io::Error::other("boom"),
        };
        let s = tonic::Status::from(io);
        assert_eq!(s.code(), tonic::Code::Internal);
        assert_eq!(s.message(), "binding socket /x.sock: boom");
        let b = PluginError::Backend {
            op: "list GPUs".into(),
            source: carve_gpu::BackendError::Unavailable {
                reason: "no lib".into(),
            },
        };
        assert_eq!(tonic::Status::from(b).code(), tonic::Code::Unavailable);
    }
}
