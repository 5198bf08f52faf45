//! Errors of this crate.

use std::net::SocketAddr;

/// What can go wrong serving metrics or setting up tracing.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The listening socket could not be bound (address in use, not local,
    /// no permission).
    #[error("metrics endpoint: cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed while serving.
    #[error("metrics endpoint on {addr}: {source}")]
    Serve {
        /// The bound address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server task panicked or was cancelled.
    #[error("metrics endpoint on {addr}: server task ended abnormally: {reason}")]
    Task {
        /// The bound address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A log filter from the environment does not parse.
    #[error("log filter {var}={value:?} is invalid: {reason}")]
    LogFilter {
        /// The environment variable (`CARVE_LOG` or `RUST_LOG`).
        var: &'static str,
        /// Its value.
        value: String,
        /// The parser's complaint.
        reason: String,
    },
    /// A global tracing subscriber was already installed.
    #[error("tracing is already initialised in this process: {0}")]
    TracingInit(String),
}
