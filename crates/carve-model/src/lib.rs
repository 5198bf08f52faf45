//! The pure domain of carve: GPU models, MIG profiles and placements, placement
//! math, counters, device names and (in [`slices`]) the ResourceSlices a node
//! publishes.
//!
//! This crate does no I/O, uses neither tokio nor NVML. At runtime the GPU
//! inventory comes from NVML through `carve-gpu`; the tables in [`models`] are
//! fixtures for the simulator and tests and are never the only source of truth on
//! real hardware.

pub mod geometry;
pub mod health;
pub mod models;
pub mod names;
pub mod order;
pub mod scheduler;
pub mod sharing;
pub mod slices;
pub mod spec;

pub use geometry::{Instance, Layout, Occupancy, Stranded};
pub use models::{GpuModel, MODELS};
pub use names::{DeviceName, NameError, ProfileToken};
pub use spec::{Architecture, Engines, GpuSpec, MigProfile, PhysicalGpu, Placement, SpecError};

/// The DRA driver name of carve.
pub const DRIVER_NAME: &str = "gpu.carve.dev";
