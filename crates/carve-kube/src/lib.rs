//! carve-kube
