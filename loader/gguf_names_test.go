package loader

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"

	"github.com/strata-llm/strata/tensor/quant"
)

func TestGGUFNames(t *testing.T) {
	cases := []struct{ gguf, hf string }{
		{"token_embd.weight", "model.embed_tokens.weight"},
		{"output_norm.weight", "model.norm.weight"},
		{"output.weight", "lm_head.weight"},
		{"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
		{"blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"},
		{"blk.7.attn_q.bias", "model.layers.7.self_attn.q_proj.bias"},
		{"blk.12.attn_k.weight", "model.layers.12.self_attn.k_proj.weight"},
		{"blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"},
		{"blk.31.attn_output.weight", "model.layers.31.self_attn.o_proj.weight"},
		{"blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"},
		{"blk.2.attn_k_norm.weight", "model.layers.2.self_attn.k_norm.weight"},
		{"blk.5.ffn_norm.weight", "model.layers.5.post_attention_layernorm.weight"},
		{"blk.5.ffn_gate.weight", "model.layers.5.mlp.gate_proj.weight"},
		{"blk.5.ffn_up.weight", "model.layers.5.mlp.up_proj.weight"},
		{"blk.100.ffn_down.weight", "model.layers.100.mlp.down_proj.weight"},
	}
	for _, c := range cases {
		if got, ok := GGUFToHFName(c.gguf); !ok || got != c.hf {
			t.Errorf("GGUFToHFName(%s) = %q, %v; want %s", c.gguf, got, ok, c.hf)
		}
		if got, ok := HFToGGUFName(c.hf); !ok || got != c.gguf {
			t.Errorf("HFToGGUFName(%s) = %q, %v; want %s", c.hf, got, ok, c.gguf)
		}
	}
	for _, bad := range []string{"blk.x.attn_q.weight", "blk.01.attn_q.weight", "blk.-1.attn_q.weight", "blk.1.attn_qkv.weight",
		"blk.1", "rope_freqs.weight", "model.layers.1.self_attn.rotary_emb.inv_freq", "model.layers..mlp.up_proj.weight", ""} {
		if got, ok := GGUFToHFName(bad); ok {
			t.Errorf("GGUFToHFName(%q) = %q, want no mapping", bad, got)
		}
		if got, ok := HFToGGUFName(bad); ok {
			t.Errorf("HFToGGUFName(%q) = %q, want no mapping", bad, got)
		}
	}
	if !GGUFPermutesQK("llama") || GGUFPermutesQK("qwen2") || GGUFPermutesQK("qwen3") {
		t.Error("GGUFPermutesQK: only llama files are permuted")
	}
}

// converterPermute is the converter's operation written as its array
// reshape: rows viewed as [heads][2][d/2] are transposed to [heads][d/2][2].
func converterPermute(rows [][]float32, heads int) [][]float32 {
	d := len(rows) / heads
	out := make([][]float32, 0, len(rows))
	for h := range heads {
		for i := range d / 2 { // the new middle axis
			for s := range 2 { // the new inner axis
				out = append(out, rows[h*d+s*(d/2)+i])
			}
		}
	}
	return out
}

func f32Rows(rows [][]float32) []byte {
	var b []byte
	for _, r := range rows {
		for _, v := range r {
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
		}
	}
	return b
}

func TestUnpermuteQK(t *testing.T) {
	for _, c := range []struct{ heads, d, cols int }{{4, 8, 3}, {2, 64, 256}, {1, 2, 1}, {8, 16, 512}} {
		rows := make([][]float32, c.heads*c.d)
		for r := range rows {
			rows[r] = make([]float32, c.cols)
			for k := range rows[r] {
				rows[r][k] = float32(r*1000 + k)
			}
		}
		hf := f32Rows(rows)
		want := f32Rows(converterPermute(rows, c.heads))
		got := make([]byte, len(hf))
		if err := PermuteQK(got, hf, len(rows), c.heads); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%+v: PermuteQK differs from the converter's reshape", c)
		}
		back := make([]byte, len(hf))
		if err := UnpermuteQK(back, got, len(rows), c.heads); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, hf) {
			t.Errorf("%+v: UnpermuteQK does not undo PermuteQK", c)
		}
	}
}

// TestUnpermuteQKQuantized: rows are whole blocks, so reordering quantized
// rows equals quantizing reordered rows, byte for byte.
func TestUnpermuteQKQuantized(t *testing.T) {
	const heads, d, cols = 4, 8, 512
	rows := make([][]float32, heads*d)
	for r := range rows {
		rows[r] = make([]float32, cols)
		for k := range rows[r] {
			rows[r][k] = float32(math.Sin(float64(r*cols+k))) * 0.05
		}
	}
	for _, typ := range []quant.Type{quant.Q4_K, quant.Q8_0, quant.Q6_K} {
		quantize := func(rs [][]float32) []byte {
			var out []byte
			for _, r := range rs {
				q := make([]byte, cols/typ.BlockSize()*typ.BlockBytes())
				if err := typ.Quantize(q, r); err != nil {
					t.Fatal(err)
				}
				out = append(out, q...)
			}
			return out
		}
		gguf := quantize(converterPermute(rows, heads)) // what a converted file holds
		got := make([]byte, len(gguf))
		if err := UnpermuteQK(got, gguf, len(rows), heads); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, quantize(rows)) {
			t.Errorf("%v: unpermuted quantized rows differ from the quantized Hugging Face rows", typ)
		}
	}
}

// TestUnpermuteQKRope checks what the permutation is for: rotating
// interleaved pairs (2i, 2i+1) of a head of the permuted projection gives
// the permuted result of rotating Hugging Face's pairs (i, i+d/2).
func TestUnpermuteQKRope(t *testing.T) {
	const d, heads = 16, 2
	q := make([]float32, d*heads) // one projected query vector, HF order
	for i := range q {
		q[i] = float32(math.Cos(float64(i) * 1.7))
	}
	pos := 5.0
	theta := func(i int) float64 { return pos * math.Pow(10000, -2*float64(i)/d) }
	rotHF := make([]float32, len(q))
	for h := range heads {
		for i := range d / 2 {
			a, b := float64(q[h*d+i]), float64(q[h*d+i+d/2])
			c, s := math.Cos(theta(i)), math.Sin(theta(i))
			rotHF[h*d+i], rotHF[h*d+i+d/2] = float32(a*c-b*s), float32(a*s+b*c)
		}
	}
	asRows := func(v []float32) []byte { return f32Rows([][]float32{v})[:] }
	perm := make([]byte, 4*len(q))
	if err := PermuteQK(perm, asRows(q), len(q), heads); err != nil {
		t.Fatal(err)
	}
	pq := make([]float32, len(q))
	for i := range pq {
		pq[i] = math.Float32frombits(binary.LittleEndian.Uint32(perm[4*i:]))
	}
	rotNorm := make([]float32, len(q))
	for h := range heads {
		for i := range d / 2 {
			a, b := float64(pq[h*d+2*i]), float64(pq[h*d+2*i+1])
			c, s := math.Cos(theta(i)), math.Sin(theta(i))
			rotNorm[h*d+2*i], rotNorm[h*d+2*i+1] = float32(a*c-b*s), float32(a*s+b*c)
		}
	}
	back := make([]byte, 4*len(q))
	if err := UnpermuteQK(back, asRows(rotNorm), len(q), heads); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, asRows(rotHF)) {
		t.Error("interleaved rope on permuted rows, unpermuted, differs from rotate_half rope")
	}
}

func TestUnpermuteQKRefuses(t *testing.T) {
	cases := []struct {
		name        string
		dst, src    int
		rows, heads int
	}{
		{"rows not heads", 48, 48, 12, 5},
		{"odd head size", 36, 36, 9, 3},
		{"length not rows", 50, 50, 8, 2},
		{"dst differs", 64, 32, 8, 2},
		{"zero heads", 32, 32, 8, 0},
	}
	for _, c := range cases {
		if err := UnpermuteQK(make([]byte, c.dst), make([]byte, c.src), c.rows, c.heads); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
}
