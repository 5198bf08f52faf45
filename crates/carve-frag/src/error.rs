//! The one error type of the crate.

use std::path::PathBuf;

/// Why loading a trace, configuring or writing a benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum FragError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The CSV reader could not split a record (bad quoting, wrong field count, ...).
    #[error("{path}: line {line}: malformed CSV: {source}")]
    Csv {
        /// The file.
        path: PathBuf,
        /// 1-based line of the record, 0 when unknown.
        line: u64,
        /// The reader's error.
        source: csv::Error,
    },
    /// The header lacks a column the loader needs.
    #[error("{path}: missing column `{column}` in the header")]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The column name.
        column: &'static str,
    },
    /// A field holds a value that is not valid for its column.
    #[error("{path}: line {line}, column `{column}`: bad value {value:?}: {reason}")]
    BadValue {
        /// The file.
        path: PathBuf,
        /// 1-based line of the record.
        line: u64,
        /// The column name.
        column: &'static str,
        /// The text found.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A trace file holds no data rows.
    #[error("{path}: no data rows")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The `--model` key is not one of carve-model's models.
    #[error("unknown GPU model {model:?}; known: {known}")]
    UnknownModel {
        /// What was asked for.
        model: String,
        /// The MIG-capable keys.
        known: String,
    },
    /// The model exists but cannot be partitioned, so there is nothing to place.
    #[error("GPU model {model} is not MIG-capable; use one of: {known}")]
    NotMigCapable {
        /// The model key.
        model: String,
        /// The MIG-capable keys.
        known: String,
    },
    /// A benchmark setting is out of range.
    #[error("bad setting `{field}`: {reason}")]
    Config {
        /// The setting (CLI flag name).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The chosen nodes hold no GPU, so no load can arrive.
    #[error("{path}: the selected nodes hold no GPU")]
    NoGpus {
        /// The node list.
        path: PathBuf,
    },
    /// Writing the CSV output failed; the destination is left as it was.
    #[error("writing {path}: {source}")]
    Write {
        /// The destination file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
