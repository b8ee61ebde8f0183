//go:build !amd64 || purego

package quant

// archKernels returns the assembly kernel tables this machine runs,
// fastest first: none off x86-64, or when built with the purego tag.
func archKernels() []*vecKernels { return nil }
