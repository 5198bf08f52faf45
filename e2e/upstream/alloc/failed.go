//go:build !carve_dra_v134

package main

import (
	"errors"

	"k8s.io/dynamic-resource-allocation/structured"
)

// isFailedAllocation: since 1.35 the allocator may say that the claims do
// not fit with an error wrapping structured.ErrFailedAllocationOnNode
// instead of a nil result.
func isFailedAllocation(err error) bool {
	return errors.Is(err, structured.ErrFailedAllocationOnNode)
}
