package loader

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"os"
	"path/filepath"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/tensor"
)

// SynthOptions control Synthesize.
type SynthOptions struct {
	// DType of the weights: F16, BF16 or F32. Invalid (the zero value)
	// means cfg.DType.
	DType tensor.DType
	// Seed makes the weights: the same seed, config and dtype give the same
	// bytes, whatever the shard size or number of workers.
	Seed int64
	// MaxShardBytes splits the weights into shards with an index when they
	// add up to more than this; 0 writes one model.safetensors.
	MaxShardBytes int64
	// TokenizerFrom, if set, is a model directory whose tokenizer files
	// (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
	// tokenizer.model) are copied, so that text prompts work.
	TokenizerFrom string
	// Workers bounds the goroutines generating weights; 0 means GOMAXPROCS.
	Workers int
	// Progress, if set, is called with the weight bytes written so far and
	// the total, possibly from several goroutines at once.
	Progress func(written, total int64)
}

// Synthesize writes a random-weight model of shape cfg into dir:
// config.json, generation_config.json, the weights (sharded as opts says)
// and optionally a tokenizer. The model is written as a whole through
// ReplaceModelDir: a model already in dir is replaced only once the new one
// is complete, a failure (a full disk, a cancelled ctx) leaves dir as it
// was, and dir may hold nothing but a model's files. Open accepts the
// result.
//
// The weights are uniform random values chosen so that activations keep a
// sane scale through any number of layers: projections have standard
// deviation 1/sqrt(in_features) (o_proj and the down projections of the
// MLP and the experts a further 1/sqrt(2*layers), so the residual stream
// grows slowly), the embedding and LM head 1/sqrt(hidden), norm weights (the
// q/k norms too) are 1 plus noise of 0.02, biases
// noise of 0.02 (each uniform over 65536 levels). Generation runs in
// parallel with a counter-based generator (splitmix64 keyed by seed and
// tensor name) and table lookups, so it keeps up with the disk.
func Synthesize(ctx context.Context, dir string, cfg *arch.Config, opts SynthOptions) error {
	if cfg == nil {
		return errors.New("loader: synthesize: nil config")
	}
	c := cfg.Clone()
	if opts.DType != tensor.Invalid {
		c.DType = opts.DType
	}
	if !c.DType.IsFloat() {
		return fmt.Errorf("loader: synthesize: dtype %v is not F16, BF16 or F32", c.DType)
	}
	if err := c.Validate(); err != nil {
		return err
	}
	if opts.MaxShardBytes < 0 {
		return fmt.Errorf("loader: synthesize: negative shard size %d", opts.MaxShardBytes)
	}
	var tokFiles []string
	if opts.TokenizerFrom != "" {
		var err error
		if tokFiles, err = checkTokenizer(opts.TokenizerFrom, c.VocabSize); err != nil {
			return err
		}
	}
	return ReplaceModelDir(dir, func(tmp string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		return synthesizeInto(ctx, tmp, c, opts, tokFiles)
	})
}

// synthesizeInto writes the model into the fresh directory dir.
func synthesizeInto(ctx context.Context, dir string, c *arch.Config, opts SynthOptions, tokFiles []string) error {
	w := NewShardedWriter(dir, opts.MaxShardBytes)
	w.Workers, w.Progress = opts.Workers, opts.Progress
	tables := map[[2]float32]*levelTable{} // few distinct distributions
	for _, spec := range c.ExpectedTensors() {
		center, halfWidth := synthInit(c, spec)
		tab := tables[[2]float32{center, halfWidth}]
		if tab == nil {
			tab = newLevelTable(c.DType, center, halfWidth)
			tables[[2]float32{center, halfWidth}] = tab
		}
		g := &uniformGen{tab: tab, key: tensorKey(opts.Seed, spec.Name)}
		if err := w.Add(spec.Name, c.DType, spec.Shape, g.fill); err != nil {
			return err
		}
	}
	if _, err := w.Write(ctx); err != nil {
		return err
	}

	cfgJSON, err := c.MarshalJSON()
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, ConfigFile), cfgJSON); err != nil {
		return fmt.Errorf("loader: synthesize: %w", err)
	}
	gen := map[string]any{"_from_model_config": true}
	if c.BOS >= 0 {
		gen["bos_token_id"] = c.BOS
	}
	switch len(c.EOS) {
	case 0:
	case 1:
		gen["eos_token_id"] = c.EOS[0]
	default:
		gen["eos_token_id"] = c.EOS
	}
	genJSON, _ := json.MarshalIndent(gen, "", "  ")
	if err := atomicfile.WriteFile(filepath.Join(dir, "generation_config.json"), append(genJSON, '\n')); err != nil {
		return fmt.Errorf("loader: synthesize: %w", err)
	}
	for _, name := range tokFiles {
		if err := copyFile(filepath.Join(opts.TokenizerFrom, name), filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}

// SynthesizeOpen synthesises a model into dir and opens it.
func SynthesizeOpen(ctx context.Context, dir string, cfg *arch.Config, opts SynthOptions) (*Model, error) {
	if err := Synthesize(ctx, dir, cfg, opts); err != nil {
		return nil, err
	}
	return Open(dir)
}

// synthInit returns the centre and half-width of the uniform distribution
// for a tensor.
func synthInit(c *arch.Config, spec arch.Spec) (center, halfWidth float32) {
	const sqrt3 = 1.7320508075688772
	std := func(s float64) float32 { return float32(s * sqrt3) }
	switch spec.Role {
	case arch.AttnNorm, arch.MLPNorm, arch.FinalNorm, arch.QNorm, arch.KNorm:
		return 1, std(0.02)
	case arch.QBias, arch.KBias, arch.VBias, arch.OBias:
		return 0, std(0.02)
	case arch.Embed, arch.LMHead:
		return 0, std(1 / math.Sqrt(float64(c.HiddenSize)))
	}
	in := float64(spec.Shape[len(spec.Shape)-1])
	s := 1 / math.Sqrt(in)
	if spec.Role == arch.O || spec.Role == arch.Down || spec.Role == arch.ExpertDown || spec.Role == arch.SharedDown {
		s /= math.Sqrt(2 * float64(c.NumLayers))
	}
	return 0, std(s)
}

// tensorKey derives a tensor's generator key from the seed and its name.
func tensorKey(seed int64, name string) uint64 {
	h := fnv.New64a()
	io.WriteString(h, name)
	return mix64(uint64(seed)*0x9e3779b97f4a7c15 ^ h.Sum64())
}

// mix64 is the splitmix64 output function: a bijective scrambler of 64-bit
// words.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

const golden = 0x9e3779b97f4a7c15

// Values are drawn from 65536 levels: element i takes 16 bits of the
// splitmix64 output for counter i/4, and those bits index a table of the
// levels already encoded in the output dtype. One generator call and four
// table loads per four elements keep a core writing gigabytes per second.
// Level k is center + halfWidth*(2k+1-65536)/65536, computed in float32 and
// then rounded to F16 or BF16, so a model synthesised in F16 or BF16 holds
// exactly the F32 model's values rounded.

// levelTable holds the 65536 levels of one distribution in one dtype: the
// float32 bits for F32, the 16-bit words for F16 and BF16.
type levelTable struct {
	dt  tensor.DType
	w32 *[1 << 16]uint32
	w16 *[1 << 16]uint16
}

func newLevelTable(dt tensor.DType, center, halfWidth float32) *levelTable {
	t := &levelTable{dt: dt}
	if dt == tensor.F32 {
		t.w32 = new([1 << 16]uint32)
	} else {
		t.w16 = new([1 << 16]uint16)
	}
	for k := range 1 << 16 {
		v := center + halfWidth*(float32(2*k+1-(1<<16))*(1.0/(1<<16)))
		switch dt {
		case tensor.F32:
			t.w32[k] = math.Float32bits(v)
		case tensor.F16:
			t.w16[k] = tensor.F16FromF32(v)
		case tensor.BF16:
			t.w16[k] = tensor.BF16FromF32(v)
		}
	}
	return t
}

// uniformGen fills a tensor with values uniform over the levels of its
// table, element i depending only on (key, i). It is a struct with a method
// rather than a closure so that the compiler inlines the generator into the
// loops.
type uniformGen struct {
	tab *levelTable
	key uint64
}

// fill is a FillFunc. The range may start or end inside an element.
func (g *uniformGen) fill(dst []byte, off int64) error {
	esize := int64(g.tab.dt.Size())
	var tmp [4]byte
	if r := off % esize; r != 0 { // the tail of a split element
		g.put(tmp[:], off/esize)
		k := copy(dst, tmp[r:esize])
		dst, off = dst[k:], off+int64(k)
	}
	e := off / esize
	n := int64(len(dst)) / esize
	// Elements before the first multiple of four and after the last one
	// go one at a time; the loops in between take four per generator call.
	for ; e&3 != 0 && n > 0; e, n = e+1, n-1 {
		g.put(dst, e)
		dst = dst[esize:]
	}
	quads := int(n / 4)
	ctr := g.key + uint64(e>>2)*golden
	if w := g.tab.w32; w != nil {
		out := dst[:16*quads]
		for p := 0; p+16 <= len(out); p += 16 {
			r := mix64(ctr)
			ctr += golden
			binary.LittleEndian.PutUint64(out[p:], uint64(w[uint16(r)])|uint64(w[uint16(r>>16)])<<32)
			binary.LittleEndian.PutUint64(out[p+8:], uint64(w[uint16(r>>32)])|uint64(w[uint16(r>>48)])<<32)
		}
	} else {
		w := g.tab.w16
		out := dst[:8*quads]
		for p := 0; p+8 <= len(out); p += 8 {
			r := mix64(ctr)
			ctr += golden
			binary.LittleEndian.PutUint64(out[p:], uint64(w[uint16(r)])|uint64(w[uint16(r>>16)])<<16|
				uint64(w[uint16(r>>32)])<<32|uint64(w[uint16(r>>48)])<<48)
		}
	}
	dst = dst[int64(quads)*4*esize:]
	for e += int64(quads) * 4; int64(len(dst)) >= esize; e++ {
		g.put(dst, e)
		dst = dst[esize:]
	}
	if len(dst) > 0 { // the head of a split element
		g.put(tmp[:], e)
		copy(dst, tmp[:])
	}
	return nil
}

// put stores element e at the start of b.
func (g *uniformGen) put(b []byte, e int64) {
	k := uint16(mix64(g.key+uint64(e>>2)*golden) >> (16 * (e & 3)))
	if g.tab.w32 != nil {
		binary.LittleEndian.PutUint32(b, g.tab.w32[k])
	} else {
		binary.LittleEndian.PutUint16(b, g.tab.w16[k])
	}
}

// Tokenizer files copied by SynthOptions.TokenizerFrom.
var tokenizerFiles = []string{TokenizerFile, TokenizerConfig, "special_tokens_map.json", "tokenizer.model"}

// checkTokenizer returns the tokenizer files present in dir, checking that
// there is a tokenizer and that its ids fit in the vocabulary.
func checkTokenizer(dir string, vocab int) ([]string, error) {
	var have []string
	for _, name := range tokenizerFiles {
		if fileExists(filepath.Join(dir, name)) {
			have = append(have, name)
		}
	}
	if len(have) == 0 || !fileExists(filepath.Join(dir, TokenizerFile)) && !fileExists(filepath.Join(dir, "tokenizer.model")) {
		return nil, fmt.Errorf("loader: synthesize: no %s or tokenizer.model in %s", TokenizerFile, dir)
	}
	path := filepath.Join(dir, TokenizerFile)
	data, err := infile.ReadFile(context.Background(), path)
	if errors.Is(err, os.ErrNotExist) {
		return have, nil
	}
	if err != nil {
		return nil, fmt.Errorf("loader: synthesize: %w", err)
	}
	var tok struct {
		Model struct {
			Vocab json.RawMessage `json:"vocab"`
		} `json:"model"`
		AddedTokens []struct {
			ID int `json:"id"`
		} `json:"added_tokens"`
	}
	if err := json.Unmarshal(data, &tok); err != nil {
		return nil, fmt.Errorf("loader: synthesize: %s: bad JSON: %v", path, err)
	}
	maxID := -1
	var byName map[string]int
	var list []json.RawMessage
	if json.Unmarshal(tok.Model.Vocab, &byName) == nil {
		for _, id := range byName {
			maxID = max(maxID, id)
		}
	} else if json.Unmarshal(tok.Model.Vocab, &list) == nil {
		maxID = len(list) - 1
	}
	for _, a := range tok.AddedTokens {
		maxID = max(maxID, a.ID)
	}
	if maxID >= vocab {
		return nil, fmt.Errorf("loader: synthesize: %s has token id %d, outside the model's vocabulary of %d", path, maxID, vocab)
	}
	return have, nil
}

func copyFile(src, dst string) error {
	data, err := infile.ReadFile(context.Background(), src)
	if err != nil {
		return fmt.Errorf("loader: synthesize: %w", err)
	}
	if err := atomicfile.WriteFile(dst, data); err != nil {
		return fmt.Errorf("loader: synthesize: %w", err)
	}
	return nil
}
