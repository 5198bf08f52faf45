//! carve-alloc
