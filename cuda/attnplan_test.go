package cuda

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestPlanAttention checks, without a GPU, which kernel each call takes.
func TestPlanAttention(t *testing.T) {
	all := func(string) bool { return true }
	volta := func(name string) bool { return !strings.HasPrefix(name, "flash_") }
	for _, c := range []struct {
		t, headDim, pos0 int
		dt               tensor.DType
		aligned, precise bool
		has              func(string) bool
		kernel           string
		splits           int
	}{
		{1, 128, 15, tensor.F16, true, false, all, "attention_split_f16_d128", 1},
		{1, 128, 63, tensor.F16, true, false, all, "attention_split_f16_d128", 1},
		{1, 128, 127, tensor.F16, true, false, all, "attention_split_f16_d128", 2},
		{1, 128, 8191, tensor.F16, true, false, all, "attention_split_f16_d128", 128},
		{1, 128, 40000, tensor.Q8_0, true, false, all, "attention_split_q8_0_d128", 126},
		{1, 128, 8192, tensor.Q8_0, true, false, all, "attention_split_q8_0_d128", 86},
		{4, 64, 1000, tensor.F32, true, false, all, "attention_split_f32_d64", 16},
		{1, 256, 3000, tensor.BF16, true, false, all, "attention_split_bf16_d256", 47},
		{1, 96, 3000, tensor.F16, true, false, all, "attention_f16", 0},
		{1, 128, 3000, tensor.F16, false, false, all, "attention_f16", 0},
		{5, 128, 3000, tensor.F16, true, false, all, "attention_f16", 0},
		{16, 128, 0, tensor.F16, true, false, all, "flash_attention_f16_d128", 0},
		{8000, 64, 0, tensor.Q8_0, true, false, all, "flash_attention_q8_0_d64", 0},
		{8000, 128, 0, tensor.F16, true, false, volta, "attention_f16", 0},
		{8000, 128, 0, tensor.F32, true, true, all, "attention_f32", 0},
		{8000, 256, 0, tensor.F32, true, false, all, "attention_f32", 0},
	} {
		p := planAttention(c.t, 32, c.headDim, c.pos0, c.dt, c.aligned, c.precise, splitChunk, c.has)
		if p.kernel != c.kernel || p.splits != c.splits {
			t.Errorf("T=%d D=%d pos0=%d %v aligned=%v precise=%v: %s with %d splits, want %s with %d", c.t, c.headDim, c.pos0, c.dt, c.aligned, c.precise, p.kernel, p.splits, c.kernel, c.splits)
		}
		if p.splits > 0 && p.chunk*p.splits < c.pos0+c.t {
			t.Errorf("T=%d pos0=%d: %d splits of %d positions miss some", c.t, c.pos0, p.splits, p.chunk)
		}
		if pass := splitPass(c.headDim, c.dt); p.splits > 0 && p.chunk%pass != 0 {
			t.Errorf("T=%d D=%d pos0=%d %v: chunks of %d, not whole passes of %d", c.t, c.headDim, c.pos0, c.dt, p.chunk, pass)
		}
	}
	for _, c := range []struct {
		v     string
		chunk int
		ok    bool
	}{{"", splitChunk, true}, {"256", 256, true}, {"1", 1, true}, {"0", 0, false}, {"4097", 0, false}, {"64k", 0, false}} {
		chunk, err := splitChunkNamed(c.v)
		if (err == nil) != c.ok || chunk != c.chunk {
			t.Errorf("%s=%q: chunk %d, error %v; want %d, error %v", SplitChunkEnv, c.v, chunk, err, c.chunk, !c.ok)
		}
	}
	if p := planAttention(1, 32, 128, 1000, tensor.F16, true, false, 256, all); p.splits != 4 || p.chunk != 256 {
		t.Errorf("chunk 256 at 1000: %d splits of %d, want 4 of 256", p.splits, p.chunk)
	}
	// Many heads of 256 and 4 queries: the partials of 128 splits would
	// pass the scratch arena's half (64·4·128·258·4 = 33.8 MB).
	p := planAttention(4, 64, 256, 40000, tensor.F16, true, false, splitChunk, all)
	if bytes := 64 * 4 * p.splits * 258 * 4; p.splits < 2 || bytes > splitPartBytes || p.chunk*p.splits < 40004 {
		t.Errorf("64 heads of 256, 4 queries at 40000: %d splits of %d, %d bytes of partials (at most %d)", p.splits, p.chunk, bytes, splitPartBytes)
	}
}

// TestKernelConstants checks that the kernels' sources define what the
// host's constants say: the merge's room for splitMax splits, the split
// kernel's warps and steps (splitPass), and the
// float4 a thread of the norm kernels holds (normThreads sizes blocks by
// it).
func TestKernelConstants(t *testing.T) {
	for _, c := range []struct {
		file, define string
		want         int
	}{
		{"kernels/attention_split.cuh", "SPLIT_MAX", splitMax},
		{"kernels/attention_split.cuh", "SPLIT_WARPS", splitWarps},
		{"kernels/attention_split.cuh", "SPLIT_STEPS", splitSteps},
		{"kernels/norm.cuh", "NORM_VEC", normVec},
	} {
		data, err := os.ReadFile(c.file)
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("#define %s %d\n", c.define, c.want)
		if !strings.Contains(string(data), want) {
			t.Errorf("%s does not say %q", c.file, strings.TrimSpace(want))
		}
	}
}

// TestNormThreads checks the norm kernels' blocks: whole warps, at most
// 1024 threads, and enough of them to hold rows of up to 8192 elements.
func TestNormThreads(t *testing.T) {
	for _, c := range []struct {
		n    int
		want uint32
	}{{1, 32}, {128, 32}, {256, 32}, {257, 64}, {2048, 256}, {4096, 512}, {5120, 640}, {8192, 1024}, {8200, 1024}, {1 << 20, 1024}} {
		got := normThreads(c.n)
		if got != c.want {
			t.Errorf("normThreads(%d) = %d, want %d", c.n, got, c.want)
		}
		if c.n <= 8192 && int(got)*4*normVec < c.n {
			t.Errorf("normThreads(%d) = %d: holds %d elements", c.n, got, int(got)*4*normVec)
		}
	}
}
