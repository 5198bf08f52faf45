//! carve-nvml-sim
