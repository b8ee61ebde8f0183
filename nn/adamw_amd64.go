package nn

import "golang.org/x/sys/cpu"

var hasAVX2FMA = cpu.X86.HasAVX2 && cpu.X86.HasFMA

// adamAVX2 updates n elements (a multiple of 8) with AVX2 and FMA.
//
//go:noescape
func adamAVX2(w, grad, m, v *float32, n int, c *adamConsts)

// adamUpdateArch updates the longest prefix the vector kernel handles and
// returns its length.
func adamUpdateArch(w, g, m, v []float32, c *adamConsts) int {
	n := len(w) &^ 7
	if !hasAVX2FMA || n == 0 {
		return 0
	}
	adamAVX2(&w[0], &g[0], &m[0], &v[0], n, c)
	return n
}
