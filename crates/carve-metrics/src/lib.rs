//! carve's observability: the Prometheus metrics the driver exports (a
//! [`Metrics`] registry with typed recording methods, so callers never build
//! label sets), the HTTP endpoint serving them with liveness and readiness
//! probes ([`serve`], [`bind`]), and the tracing setup ([`init_tracing`]).
//!
//! It is not a metrics pipeline: no push, no protobuf exposition, no
//! authentication on the endpoint, and it measures nothing by itself — the
//! plugin, publisher and NVML layer call the recording methods.

mod error;
mod metrics;
mod server;
mod trace;

pub use error::MetricsError;
pub use metrics::{ApiVerb, DeviceType, FailureReason, Metrics, OPENMETRICS_CONTENT_TYPE, Outcome};
pub use server::{MetricsServer, ReadyCheck, bind, serve};
pub use trace::{CARVE_LOG_ENV, DEFAULT_FILTER, ansi_colours, env_filter, init_tracing};
