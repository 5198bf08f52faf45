//go:build carve_dra_v134

package main

// isFailedAllocation: 1.34's allocator says that the claims do not fit only
// with a nil result; every error is a fatal one.
func isFailedAllocation(error) bool { return false }
