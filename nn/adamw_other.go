//go:build !amd64

package nn

// adamUpdateArch has no vector kernel off x86-64.
func adamUpdateArch(w, g, m, v []float32, c *adamConsts) int { return 0 }

// hasAVX2FMA is false off x86-64.
const hasAVX2FMA = false
