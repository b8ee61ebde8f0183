package tensor

import (
	"strings"
	"testing"
)

// normFuserCPU counts the folds it is asked for, and folds none.
type normFuserCPU struct {
	*CPU
	calls int
}

func (f *normFuserCPU) Folds(x, g *Tensor, ws ...*Tensor) bool { return true }
func (f *normFuserCPU) NormMatMulMany(outs []*Tensor, x, g *Tensor, eps float32, ws []*Tensor) (bool, error) {
	f.calls++
	return false, nil
}
func (f *normFuserCPU) NormGateUpSiLU(out, x, g *Tensor, eps float32, wGate, wUp *Tensor) (bool, error) {
	f.calls++
	return false, nil
}
func (f *normFuserCPU) MatMulAdd(out, x, w *Tensor) (bool, error) {
	f.calls++
	return false, nil
}

// TestNormFuserHelpers: the helpers check the operands before a backend
// folds them, one line naming the problem; a backend without the
// capability folds nothing and says so; FoldsNorms asks the backend, also
// behind Checked.
func TestNormFuserHelpers(t *testing.T) {
	cpu := NewCPU(1)
	defer cpu.Close()
	x, g := New(F32, Shape{1, 8}), New(F16, Shape{8})
	w, w2 := New(F16, Shape{4, 8}), New(F16, Shape{4, 8})
	out, out2 := New(F32, Shape{1, 4}), New(F32, Shape{1, 4})
	if ok, err := NormMatMulMany(cpu, []*Tensor{out}, x, g, 1e-5, []*Tensor{w}); ok || err != nil {
		t.Errorf("the CPU folds: %v, %v", ok, err)
	}
	if FoldsNorms(cpu, x, g, w) {
		t.Error("FoldsNorms: the CPU folds")
	}
	f := &normFuserCPU{CPU: cpu}
	if !FoldsNorms(Checked(f), x, g, w) {
		t.Error("FoldsNorms does not see the capability behind Checked")
	}
	for _, tc := range []struct {
		name string
		call func() (bool, error)
		want string // "" for no error
	}{
		{"many", func() (bool, error) { return NormMatMulMany(f, []*Tensor{out, out2}, x, g, 1e-5, []*Tensor{w, w2}) }, ""},
		{"many, g short", func() (bool, error) {
			return NormMatMulMany(f, []*Tensor{out}, x, New(F16, Shape{7}), 1e-5, []*Tensor{w})
		}, "g"},
		{"many, out is x", func() (bool, error) {
			return NormMatMulMany(f, []*Tensor{x}, x, g, 1e-5, []*Tensor{New(F16, Shape{8, 8})})
		}, "overlap"},
		{"gate-up", func() (bool, error) { return NormGateUpSiLU(f, out, x, g, 1e-5, w, w2) }, ""},
		{"gate-up, up's shape", func() (bool, error) { return NormGateUpSiLU(f, out, x, g, 1e-5, w, New(F16, Shape{5, 8})) }, "wUp"},
		{"add", func() (bool, error) { return MatMulAdd(f, out, x, w) }, ""},
		{"add, out's width", func() (bool, error) { return MatMulAdd(f, New(F32, Shape{1, 5}), x, w) }, "out"},
	} {
		f.calls = 0
		_, err := tc.call()
		switch {
		case tc.want == "" && (err != nil || f.calls != 1):
			t.Errorf("%s: %v, %d calls to the backend", tc.name, err, f.calls)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || f.calls != 0 || strings.Contains(err.Error(), "\n")):
			t.Errorf("%s: %v (%d calls), want one line naming %q", tc.name, err, f.calls, tc.want)
		}
	}
}
