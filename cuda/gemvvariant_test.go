package cuda

import "testing"

// TestGEMVForShape checks the PDL variant each product's shape runs on
// under auto (forShape), on the shapes of the 7B and TinyLlama-1.1B
// decoders and their LM heads, that "auto" names it, and that every other
// variant runs its own kernels whatever the shape.
func TestGEMVForShape(t *testing.T) {
	v, rows, err := gemvVariantNamed("auto")
	if err != nil || v != gemvShaped || rows != 0 {
		t.Fatalf(`gemvVariantNamed("auto") = %v, %d, %v`, v, rows, err)
	}
	for _, c := range []struct {
		n, k int
		want string
	}{
		{3 * 4096, 4096, "s2p"}, // 7B q, k, v
		{4096, 4096, "s2p"},     // 7B o
		{11008, 4096, "s2p"},    // 7B gate and up
		{4096, 11008, "s4p"},    // 7B down
		{32000, 4096, "s2p"},    // 7B head
		{4096, 14336, "s4p"},    // Mistral down
		{2048 + 2*256, 2048, "b8p"},
		{2048, 2048, "b8p"},
		{5632, 2048, "b8p"},
		{2048, 5632, "s4p"}, // TinyLlama down
		{32000, 2048, "b8p"},
	} {
		if got := gemvShaped.forShape(c.n, c.k); got.name != c.want || !got.pdl || got.shaped {
			t.Errorf("auto, N%d K%d: %s, want %s", c.n, c.k, got.name, c.want)
		}
	}
	for i := range gemvVariants {
		if v := &gemvVariants[i]; v.forShape(2048, 2048) != v || v.forShape(4096, 11008) != v {
			t.Errorf("%s.forShape: not itself", v.name)
		}
	}
}
