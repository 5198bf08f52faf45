//! Tracing setup.
//!
//! Structured fields carve's spans and events use (keep these names so logs
//! can be filtered across components):
//!
//! | field | meaning | example |
//! |---|---|---|
//! | `claim.uid` | ResourceClaim UID | `6f1c…` |
//! | `claim.name` | `namespace/name` of the claim | `default/mig-1g` |
//! | `gpu.uuid` | UUID of the physical GPU | `GPU-5a0e…` |
//! | `gpu.index` | NVML index | `0` |
//! | `mig.profile` | MIG profile name | `1g.10gb` |
//! | `mig.placement` | placement start slice | `3` |
//! | `device` | published device name | `gpu-0-mig-1g10gb-3` |
//!
//! e.g. `tracing::info!(claim.uid = %uid, gpu.uuid = %uuid, mig.profile = "1g.10gb", mig.placement = 3, "created GI")`.

use tracing_subscriber::EnvFilter;

use crate::error::MetricsError;

/// carve's own log-filter variable; wins over `RUST_LOG`.
pub const CARVE_LOG_ENV: &str = "CARVE_LOG";

/// Filter used when neither variable is set.
pub const DEFAULT_FILTER: &str = "info";

/// The filter from `CARVE_LOG`, else `RUST_LOG`, else [`DEFAULT_FILTER`]
/// (values given explicitly so it can be tested without the environment).
///
/// # Errors
/// [`MetricsError::LogFilter`] naming the variable and value that do not parse.
pub fn env_filter(
    carve_log: Option<&str>,
    rust_log: Option<&str>,
) -> Result<EnvFilter, MetricsError> {
    let (var, value) = match (carve_log, rust_log) {
        (Some(v), _) if !v.trim().is_empty() => (CARVE_LOG_ENV, v),
        (_, Some(v)) if !v.trim().is_empty() => ("RUST_LOG", v),
        _ => return Ok(EnvFilter::new(DEFAULT_FILTER)),
    };
    EnvFilter::try_new(value).map_err(|e| MetricsError::LogFilter {
        var,
        value: value.to_string(),
        reason: e.to_string(),
    })
}

/// Whether log lines carry ANSI colour: only when stderr is a terminal (a
/// container runtime's log file, a pipe or `kubectl logs` get plain text).
#[must_use]
pub fn ansi_colours() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
}

/// Installs the global subscriber: to stderr, JSON lines when `json`, else
/// human-readable text (coloured only on a terminal: [`ansi_colours`]); level
/// filter from `CARVE_LOG` or `RUST_LOG`.
///
/// # Errors
/// An unparsable filter, or a subscriber already installed.
pub fn init_tracing(json: bool) -> Result<(), MetricsError> {
    let carve = std::env::var(CARVE_LOG_ENV).ok();
    let rust = std::env::var("RUST_LOG").ok();
    let filter = env_filter(carve.as_deref(), rust.as_deref())?;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi_colours())
        .with_writer(std::io::stderr);
    let r = if json {
        b.json().flatten_event(true).try_init()
    } else {
        b.try_init()
    };
    r.map_err(|e| MetricsError::TracingInit(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_log_wins_and_bad_filters_name_the_variable() {
        assert_eq!(env_filter(None, None).unwrap().to_string(), "info");
        assert_eq!(
            env_filter(Some("debug"), Some("warn")).unwrap().to_string(),
            "debug"
        );
        assert_eq!(
            env_filter(Some(" "), Some("warn")).unwrap().to_string(),
            "warn"
        );
        let e = env_filter(None, Some("carve=loud"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RUST_LOG") && e.contains("carve=loud"), "{e}");
        let e = env_filter(Some("[[["), None).unwrap_err().to_string();
        assert!(e.contains("CARVE_LOG"), "{e}");
    }

    #[test]
    fn second_init_is_an_error_not_a_panic() {
        // The first call may or may not succeed depending on test order in
        // this binary; the second must report the conflict.
        let _ = init_tracing(false);
        let e = init_tracing(true).unwrap_err();
        assert!(matches!(e, MetricsError::TracingInit(_)), "{e}");
    }
}
