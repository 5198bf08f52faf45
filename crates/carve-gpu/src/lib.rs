//! carve-gpu
