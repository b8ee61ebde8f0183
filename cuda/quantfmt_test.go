package cuda

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestQGEMVNamed checks QGEMVEnv's values: each kind and direct variant it
// names, and a one-line error for the rest.
func TestQGEMVNamed(t *testing.T) {
	for _, c := range []struct {
		in   string
		kind qgemvKind
		v    gemvdVariant
		err  string
	}{
		{"", defaultQGEMV, defaultGEMVDVariant, ""},
		{"staged", qgemvStaged, defaultGEMVDVariant, ""},
		{"direct", qgemvDirect, defaultGEMVDVariant, ""},
		{"direct:r4u1", qgemvDirect, gemvdVariant{4, 1}, ""},
		{"direct:r2u1", qgemvDirect, gemvdVariant{2, 1}, ""},
		{"direct:r1u2", qgemvDirect, gemvdVariant{1, 2}, ""},
		{"direct8", qgemvDirect8, gemvd8Variant, ""},
		{"direct:r3u3", 0, gemvdVariant{}, "names no direct GEMV variant (have r1u2, r2u1, r2u2, r4u1, r1u4)"},
		{"staged:r2u2", 0, gemvdVariant{}, "only direct has variants"},
		{"fast", 0, gemvdVariant{}, "names no integer GEMV"},
	} {
		kind, v, err := qgemvNamed(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) || !strings.Contains(err.Error(), QGEMVEnv) {
				t.Errorf("%q: error %v, want one naming %s that says %q", c.in, err, QGEMVEnv, c.err)
			}
			continue
		}
		if err != nil || kind != c.kind || v != c.v {
			t.Errorf("%q: %v %v %v, want %v %v", c.in, kind, v, err, c.kind, c.v)
		}
	}
}

// TestGEMVDVariantsInPTX checks that the committed PTX has a direct kernel
// for every format with direct kernels and every variant MatMul may launch
// (gemvdVariants, gemvd8Variant), and the interleaved roundings of x.
func TestGEMVDVariantsInPTX(t *testing.T) {
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join("kernels", name+".ptx"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	has := func(ptx, entry string) bool { return strings.Contains(ptx, ".entry "+entry+"(") }
	for _, f := range quantFormats {
		if !f.direct {
			continue
		}
		ptx := read("gemvd_" + f.name)
		for _, v := range gemvdVariants {
			if k := "gemvd_" + f.name + "_" + v.String(); !has(ptx, k) {
				t.Errorf("kernels/gemvd_%s.ptx has no %s", f.name, k)
			}
		}
		if k := "gemvd8_" + f.name + "_" + gemvd8Variant.String(); !has(ptx, k) {
			t.Errorf("kernels/gemvd_%s.ptx has no %s", f.name, k)
		}
	}
	x := read("quantx")
	for _, k := range []string{"quantx16i", "quantx8i"} {
		if !has(x, k) {
			t.Errorf("kernels/quantx.ptx has no %s", k)
		}
	}
}

// TestGEMVDAuto checks the direct kernel's variant by rows: every variant
// it picks is one the PTX has (gemvdVariants), and the 7B's widest
// launches take two rows a warp, TinyLlama's one.
func TestGEMVDAuto(t *testing.T) {
	for _, c := range []struct {
		rows int
		want gemvdVariant
	}{{2048, gemvdVariant{1, 2}}, {4096, gemvdVariant{1, 2}}, {11008, gemvdVariant{2, 1}}, {12288, gemvdVariant{2, 1}}, {22016, gemvdVariant{2, 1}}} {
		got := gemvdAuto(c.rows)
		if got != c.want {
			t.Errorf("%d rows: %v, want %v", c.rows, got, c.want)
		}
		found := false
		for _, v := range gemvdVariants {
			found = found || v == got
		}
		if !found {
			t.Errorf("%d rows: %v is not among the kernels' variants", c.rows, got)
		}
	}
}
