//! carve-apiserver
