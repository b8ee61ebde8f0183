package nn

import (
	"fmt"
	"math"

	"github.com/strata-llm/strata/paging"
)

// Config is the shape of a Llama-family decoder, as the forward pass needs
// it. loader.Config converts to it with FromLoader.
type Config struct {
	HiddenSize       int
	IntermediateSize int
	NumLayers        int
	NumHeads         int
	NumKVHeads       int
	HeadDim          int
	VocabSize        int
	RMSNormEps       float32
	RopeTheta        float64
	RopeScaling      *RopeScaling // nil for the default rotary embedding
	TieEmbeddings    bool
	QKVBias          bool // Qwen2 and attention_bias models
	OutBias          bool // o_proj has a bias (Llama with attention_bias)
	SlidingWindow    int  // Mistral's attention window; 0 for none
	MaxPositions     int  // max_position_embeddings; 0 for no limit
	BOS              int  // -1 when none
	EOS              []int
}

// RopeScaling is the llama3 frequency rescaling of the rotary embedding.
type RopeScaling struct {
	Factor, LowFreqFactor, HighFreqFactor float64
	OriginalMaxPositions                  int
}

// Validate reports a configuration the forward pass cannot run.
func (c *Config) Validate() error {
	switch {
	case c.HiddenSize <= 0 || c.IntermediateSize <= 0 || c.NumLayers <= 0 || c.VocabSize <= 0:
		return fmt.Errorf("nn: config: sizes must be positive (hidden %d, intermediate %d, layers %d, vocab %d)",
			c.HiddenSize, c.IntermediateSize, c.NumLayers, c.VocabSize)
	case c.NumHeads <= 0 || c.NumKVHeads <= 0 || c.NumHeads%c.NumKVHeads != 0:
		return fmt.Errorf("nn: config: %d attention heads cannot share %d key/value heads", c.NumHeads, c.NumKVHeads)
	case c.HeadDim <= 0 || c.HeadDim%2 != 0:
		return fmt.Errorf("nn: config: head dimension %d must be positive and even", c.HeadDim)
	case !(c.RopeTheta > 0):
		return fmt.Errorf("nn: config: rope_theta %v must be positive", c.RopeTheta)
	case c.MaxPositions < 0 || c.SlidingWindow < 0:
		return fmt.Errorf("nn: config: max positions %d and sliding window %d must not be negative", c.MaxPositions, c.SlidingWindow)
	}
	return nil
}

// ContextLength is the most positions a session or a training window may
// span: the smaller of MaxPositions and SlidingWindow (strata does not
// implement sliding attention, so it runs only contexts within the window),
// each when set; 0 when neither is.
func (c *Config) ContextLength() int {
	n := c.MaxPositions
	if w := c.SlidingWindow; w > 0 && (n == 0 || w < n) {
		n = w
	}
	return n
}

// checkContext refuses a context of n positions longer than the model's,
// naming the limit that applies.
func (c *Config) checkContext(what string, n int) error {
	limit := c.ContextLength()
	if limit == 0 || n <= limit {
		return nil
	}
	if limit == c.SlidingWindow {
		return &contextError{fmt.Sprintf("nn: %s of %d positions exceeds the sliding attention window of %d (sliding_window), which strata does not implement", what, n, limit)}
	}
	return &contextError{fmt.Sprintf("nn: %s of %d positions exceeds the model's context of %d (max_position_embeddings)", what, n, limit)}
}

// contextError is a context longer than the model's.
type contextError struct{ msg string }

func (e *contextError) Error() string { return e.msg }
func (e *contextError) Unwrap() error { return ErrContextTooLong }

// QDim is the width of the query projection, NumHeads*HeadDim.
func (c *Config) QDim() int { return c.NumHeads * c.HeadDim }

// KVDim is the width of the key and value projections, NumKVHeads*HeadDim.
func (c *Config) KVDim() int { return c.NumKVHeads * c.HeadDim }

// InvFreq returns the rotary inverse frequencies, HeadDim/2 of them, computed
// in float32 as Hugging Face does, with llama3 rescaling applied when set.
func (c *Config) InvFreq() []float32 {
	half := c.HeadDim / 2
	inv := make([]float32, half)
	for i := range inv {
		exp := float32(2*i) / float32(c.HeadDim)
		inv[i] = float32(1 / math.Pow(c.RopeTheta, float64(exp)))
	}
	if s := c.RopeScaling; s != nil {
		old := float64(s.OriginalMaxPositions)
		lowWavelen := old / s.LowFreqFactor
		highWavelen := old / s.HighFreqFactor
		for i, f := range inv {
			wavelen := 2 * math.Pi / float64(f)
			switch {
			case wavelen < highWavelen: // high frequencies stay
			case wavelen > lowWavelen:
				inv[i] = float32(float64(f) / s.Factor)
			default:
				smooth := (old/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				inv[i] = float32((1-smooth)*float64(f)/s.Factor + smooth*float64(f))
			}
		}
	}
	return inv
}

// RopeTables returns the cos and sin tables [maxPos, HeadDim/2] in float32:
// the angle is float32(pos) * invFreq rounded to float32, as in Hugging Face.
func (c *Config) RopeTables(maxPos int) (cos, sin []float32) {
	inv := c.InvFreq()
	half := len(inv)
	cos = make([]float32, maxPos*half)
	sin = make([]float32, maxPos*half)
	for p := 0; p < maxPos; p++ {
		for i, f := range inv {
			a := float64(float32(p) * f)
			cos[p*half+i] = float32(math.Cos(a))
			sin[p*half+i] = float32(math.Sin(a))
		}
	}
	return cos, sin
}

// ActivationBytes is what one session's forward buffers take for chunks of
// up to chunk tokens: the residual stream, norm output, q, k, v, attention
// output, projection output, gate, up and logits, all F32.
func (c *Config) ActivationBytes(chunk int) int64 {
	perTok := 3*c.HiddenSize + 2*c.QDim() + 2*c.KVDim() + 2*c.IntermediateSize + c.VocabSize
	return 4 * int64(chunk) * int64(perTok)
}

// KVCacheBytes is the F32 key and value cache for maxPos positions.
func (c *Config) KVCacheBytes(maxPos int) int64 {
	return 2 * 4 * int64(c.NumLayers) * int64(maxPos) * int64(c.KVDim())
}

// RopeBytes is the cos and sin tables for maxPos positions, F32
// [maxPos, HeadDim/2] each.
func (c *Config) RopeBytes(maxPos int) int64 { return 2 * 4 * int64(maxPos) * int64(c.HeadDim/2) }

// Reserve is what a Session allocates from its model's Allocator beside the
// weights, buffer by buffer, for paging's planner: for each block keys and
// values [maxPos, KVDim] (KVCacheBytes), the rotary tables cos and sin
// [maxPos, HeadDim/2] (RopeBytes, charged to Workspace), and the forward
// buffers of a chunk (ActivationBytes): x, the norm's output and the
// projection's [chunk, Hidden], q and the attention's output [chunk, QDim],
// k and v [chunk, KVDim], gate and up [chunk, Intermediate], and, on the
// stage that holds the LM head, the logits [chunk, Vocab]. All F32.
func (c *Config) Reserve() paging.Reserve {
	row := func(n int) int64 { return 4 * int64(n) }
	return paging.Reserve{
		{Category: paging.KVCache, Bytes: row(c.KVDim()), Per: paging.PerPosition, Count: 2, PerBlock: true},
		{Category: paging.Workspace, Bytes: row(c.HeadDim / 2), Per: paging.PerPosition, Count: 2},
		{Category: paging.Activations, Bytes: row(c.HiddenSize), Per: paging.PerToken, Count: 3},
		{Category: paging.Activations, Bytes: row(c.QDim()), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.KVDim()), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.IntermediateSize), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.VocabSize), Per: paging.PerToken, Count: 1, LastLayer: true},
	}
}
