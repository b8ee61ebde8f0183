package tensortest

import "testing"

// TestQuantToleranceDefault checks the default tolerance of products with
// quantized weights: 1e-3 for a backend of F32 arithmetic, twice its
// Tolerance for a looser one, and QuantTolerance over both.
func TestQuantToleranceDefault(t *testing.T) {
	for _, c := range []struct {
		name string
		opts []Option
		want float64
	}{
		{"default", nil, 1e-3},
		{"quantized activations", []Option{QuantizedActivations()}, 1e-3},
		{"Tolerance(1e-2)", []Option{Tolerance(1e-2)}, 2e-2},
		{"QuantTolerance", []Option{Tolerance(1e-2), QuantTolerance(5e-3)}, 5e-3},
	} {
		if got := newConfig(c.opts).quantTol; got != c.want {
			t.Errorf("%s: quantized tolerance %g, want %g", c.name, got, c.want)
		}
	}
}
