//! Benchmarks of carve's driver, measured as the plugin runs on a node and
//! printed next to their targets; `carve bench <sub>` calls them and prints
//! what they return. None asserts a timing: a benchmark reports figures, a
//! test checks behaviour.
//!
//! - [`prepare`]: driver overhead per prepare/unprepare on the NVML
//!   simulator, concurrent throughput, the plugin process's RSS and its time
//!   to registration (`carve bench prepare`).
//!
//! The slice-building benchmark lives with the code it measures
//! (`carve_kube::bench`), and so does the fragmentation replay
//! (`carve_frag`).

mod error;
pub mod prepare;

pub use error::BenchError;
