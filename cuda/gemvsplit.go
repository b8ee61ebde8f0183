//go:build cuda

package cuda

// splitFor returns the variant the M = 1 products of weights with suffix
// sfx use, or nil for the default kernels: F32 weights always take the
// default.
func (b *Backend) splitFor(sfx string) *gemvVariant {
	if sfx == "f32" {
		return nil
	}
	return b.gemvSplit
}

// gemvSplitRun launches v's MatMul kernel over up to three matrices of
// rows n[i], outputs o[i] and weights w[i] laid end to end; the caller
// holds opsMu.
func (b *Backend) gemvSplitRun(v *gemvVariant, sfx string, o, w [3]uintptr, n [3]int, x uintptr, k int) error {
	a := new(args).ptr(o[0]).ptr(o[1]).ptr(o[2]).ptr(x).ptr(w[0]).ptr(w[1]).ptr(w[2]).i32(n[0]).i32(n[1]).i32(n[2]).i32(k)
	return b.run(v.kernel(sfx), v.grid(n[0]+n[1]+n[2]), [3]uint32{gemvSplitThreads, 1, 1}, a)
}
