//! End-to-end suites for carve.
