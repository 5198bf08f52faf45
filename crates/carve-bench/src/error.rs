//! The one error type of the crate.

/// Why a benchmark could not run to its figures.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An option is out of range, or the model cannot run the benchmark;
    /// the message names the `carve bench` flag.
    #[error("{0}")]
    Options(String),
    /// A file, directory or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The driver under test failed a call the benchmark makes.
    #[error("{what}: {source}")]
    Driver {
        /// The call.
        what: String,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Setting up or talking to the simulated node, the API-server stand-in
    /// or the fake kubelet failed.
    #[error("{what}: {source}")]
    Setup {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The `carve kubelet-plugin` process misbehaved: exited before
    /// registering, answered a claim with an error, or did not answer.
    #[error("{0}")]
    Plugin(String),
}

impl BenchError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn driver(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Driver {
            what: what.into(),
            source: source.into(),
        }
    }

    pub(crate) fn setup(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Setup {
            what: what.into(),
            source: source.into(),
        }
    }
}
