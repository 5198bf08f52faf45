//! carve-proto
