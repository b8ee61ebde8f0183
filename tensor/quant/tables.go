package quant

// Lookup tables from quant bits to exact float32 values: a load is cheaper
// than an integer-to-float conversion in the inner loops (1.6x for Q8_0
// dot products, 1.2x for Q4_K, in plain Go), and the values, and so the
// results, are the same.
var (
	// i8Float[b] is the signed byte b as a float.
	i8Float [256]float32
	// nibFloat[b] holds the low and high nibbles of b as floats, and
	// nibFloat8 the same less 8 (Q4_0's offset).
	nibFloat, nibFloat8 [256][2]float32
	// q6Float[q] is q-32, a Q6_K level.
	q6Float [64]float32
)

func init() {
	for i := range 256 {
		i8Float[i] = float32(int8(i))
		nibFloat[i] = [2]float32{float32(i & 15), float32(i >> 4)}
		nibFloat8[i] = [2]float32{float32(i&15 - 8), float32(i>>4 - 8)}
	}
	for i := range q6Float {
		q6Float[i] = float32(i - 32)
	}
}
