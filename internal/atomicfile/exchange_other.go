//go:build !linux

package atomicfile

// exchange swaps the directory entries a and b with two renames.
func exchange(a, b string) error { return renameSwap(a, b) }
