//! carve-nvml
