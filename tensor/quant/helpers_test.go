package quant

// gen is a small deterministic generator (splitmix64) whose values are
// the same on every platform and Go version: the golden tests depend on
// it.
type gen struct{ s uint64 }

func newGen(seed uint64) *gen { return &gen{s: seed * 0x9e3779b97f4a7c15} }

func (g *gen) next() uint64 {
	g.s += 0x9e3779b97f4a7c15
	z := g.s
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// normal is close to a standard normal value: the sum of four uniform
// 16-bit integers, centred and scaled (integer arithmetic and one
// correctly rounded division, so it is exact everywhere).
func (g *gen) normal() float32 {
	var s int64
	for range 4 {
		s += int64(g.next() >> 48)
	}
	return float32(s-131070) / 37837
}

// weights returns n values shaped like a model's weights: normal values
// with a scale that changes every 1024 elements, about one in 64 an
// outlier eight times larger, and every 97th 32-element block zero.
func weights(n int, seed uint64) []float32 {
	g := newGen(seed)
	x := make([]float32, n)
	scale := float32(0.02)
	for i := range x {
		if i%1024 == 0 {
			scale = float32(1+g.next()%64) / 1024
		}
		v := g.normal() * scale
		if g.next()%64 == 0 {
			v *= 8
		}
		if (i/32)%97 == 96 {
			v = 0
		}
		x[i] = v
	}
	return x
}
