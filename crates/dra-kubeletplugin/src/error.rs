//! The kit's errors.

use std::path::PathBuf;

/// A failure to start or run the plugin's servers (as opposed to a per-claim
/// failure, which the driver returns and the kubelet gets in the claim's
/// `error` field).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The [`crate::PluginOptions`] cannot work.
    #[error("kubelet plugin options: {field}: {problem}")]
    InvalidOptions {
        /// The offending option.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A directory, socket or lock-file operation failed.
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
    /// A socket path does not fit `sockaddr_un` even after hashing.
    #[error("socket path {path} is {len} bytes, longer than the 107 AF_UNIX allows")]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// A gRPC server failed.
    #[error("gRPC server on {socket}: {source}")]
    Serve {
        /// The socket.
        socket: PathBuf,
        /// The error.
        #[source]
        source: tonic::transport::Error,
    },
    /// A task of the kit panicked or was cancelled.
    #[error("task {what}: {reason}")]
    Task {
        /// What the task did.
        what: &'static str,
        /// The join error.
        reason: String,
    },
}
