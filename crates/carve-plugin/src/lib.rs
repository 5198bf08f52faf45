//! carve-plugin
