package tokenizer

import (
	"bytes"
	"container/heap"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// BPEOptions configure TrainBPE.
type BPEOptions struct {
	// VocabSize is the size of the id space to reach: the special tokens,
	// the 256 byte tokens and the tokens the merges make. Training stops
	// sooner when no pair of tokens occurs MinFrequency times.
	VocabSize int
	// Special tokens take the first ids, in this order. They are cut out
	// of the text before training, as Encode cuts them out, and never
	// merged with anything.
	Special []string
	// BOS and EOS name special tokens (or are empty): Encode(text, true)
	// puts BOS in front, and tokenizer_config.json names both.
	BOS, EOS string
	// MinFrequency is the fewest occurrences of a pair that is merged; 0
	// means 2.
	MinFrequency int
}

// ErrBadOptions is wrapped by the error TrainBPE returns for options it
// cannot train with.
var ErrBadOptions = errors.New("bad training options")

// BPE is a trained byte-level BPE tokenizer: the contents of its
// tokenizer.json and tokenizer_config.json, which Parse and Hugging Face's
// tokenizers library read.
type BPE struct {
	TokenizerJSON []byte
	ConfigJSON    []byte
	Merges        int // merges learned
	Vocab         int // size of the id space
}

// TrainBPE learns a byte-level BPE tokenizer of GPT-2's form from docs:
// the ByteLevel pre-tokenizer (GPT-2's split expression, no prefix space)
// and decoder, a vocabulary of the special tokens, the 256 bytes and the
// merged tokens. Each round merges the pair of adjacent tokens that occurs
// most often in the words of docs, ties going to the pair whose tokens
// come first in byte order, so the same docs and options always give the
// same file. A merge that makes a token already in the vocabulary is
// recorded and reuses its id, as the Hugging Face trainer does.
func TrainBPE(ctx context.Context, docs []string, o BPEOptions) (*BPE, error) {
	if err := CheckBPEOptions(o); err != nil {
		return nil, err
	}
	minFreq := int64(o.MinFrequency)
	if minFreq == 0 {
		minFreq = 2
	}
	tokens := append([]string(nil), o.Special...)
	ids := make(map[string]int32, o.VocabSize)
	for i, s := range tokens {
		ids[s] = int32(i)
	}
	for b := range 256 {
		ids[byteUTF8[b]] = int32(len(tokens))
		tokens = append(tokens, byteUTF8[b])
	}
	// The pipeline of the final file without merges cuts the text into
	// words exactly as the trained tokenizer's Encode will.
	skel, err := Parse(writeBPE(tokens, nil, o), nil)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: train: %w", err)
	}
	counts := map[string]int64{}
	for i, d := range docs {
		if i%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		if !utf8.ValidString(d) {
			return nil, fmt.Errorf("tokenizer: train: document %d is not valid UTF-8", i)
		}
		skel.words(d, func(w string) { counts[w]++ })
	}

	tr := newBPETrainer(tokens, counts, ids)
	var merges [][2]string
	for len(tr.tokens) < o.VocabSize {
		if len(merges)%64 == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		a, b, n := tr.best()
		if n < minFreq {
			break
		}
		merges = append(merges, [2]string{tr.tokens[a], tr.tokens[b]})
		tr.merge(a, b)
	}
	return &BPE{TokenizerJSON: writeBPE(tr.tokens, merges, o), ConfigJSON: writeBPEConfig(o),
		Merges: len(merges), Vocab: len(tr.tokens)}, nil
}

// CheckBPEOptions returns the error TrainBPE would return for o, wrapping
// ErrBadOptions, before any text is read.
func CheckBPEOptions(o BPEOptions) error {
	seen := map[string]bool{}
	for _, s := range o.Special {
		if s == "" || seen[s] {
			return fmt.Errorf("tokenizer: train: %w: special token %q is empty or given twice", ErrBadOptions, s)
		}
		if !utf8.ValidString(s) {
			return fmt.Errorf("tokenizer: train: %w: special token %q is not valid UTF-8", ErrBadOptions, s)
		}
		seen[s] = true
	}
	for _, n := range []string{o.BOS, o.EOS} {
		if n != "" && !seen[n] {
			return fmt.Errorf("tokenizer: train: %w: %q is not one of the special tokens", ErrBadOptions, n)
		}
	}
	switch base := len(o.Special) + 256; {
	case o.VocabSize < base:
		return fmt.Errorf("tokenizer: train: %w: vocabulary size %d is below the %d special and byte tokens", ErrBadOptions, o.VocabSize, base)
	case o.VocabSize > maxTokenIDs:
		return fmt.Errorf("tokenizer: train: %w: vocabulary size %d is beyond the largest supported, %d", ErrBadOptions, o.VocabSize, maxTokenIDs)
	case o.MinFrequency < 0:
		return fmt.Errorf("tokenizer: train: %w: minimum frequency %d is negative", ErrBadOptions, o.MinFrequency)
	}
	return nil
}

// words passes each word of text that the model would see to fn, in the
// byte-level alphabet when the pre-tokenizer writes one: Encode's pipeline
// up to the model, added tokens left out.
func (t *Tokenizer) words(text string, fn func(string)) {
	if text == "" {
		return
	}
	ps := t.rawAdded.split(piece{text: text, id: -1, first: true}, nil)
	emit := func(p piece) {
		if p = p.materialized(); p.text != "" {
			fn(p.text)
		}
	}
	for _, p := range ps {
		if p.id >= 0 {
			continue
		}
		if t.norm != nil {
			p.text = t.norm.normalize(p.text)
		}
		for _, q := range t.normAdded.split(p, nil) {
			switch {
			case q.id >= 0:
			case t.pre != nil:
				t.pre.preTokenize(q, emit)
			default:
				emit(q)
			}
		}
	}
}

// bpeTrainer holds the distinct words as token sequences and the count of
// every adjacent pair, which each merge updates in the words that hold
// the pair.
type bpeTrainer struct {
	tokens []string
	ids    map[string]int32
	words  [][]int32
	freq   []int64            // occurrences of each word
	pairs  map[uint64]int64   // occurrences of each pair
	where  map[uint64][]int32 // words that held the pair when it was counted (may repeat)
	queue  pairHeap
	seen   []int // the merge that last visited each word
	rounds int
}

func newBPETrainer(tokens []string, counts map[string]int64, ids map[string]int32) *bpeTrainer {
	keys := make([]string, 0, len(counts))
	for w := range counts {
		keys = append(keys, w)
	}
	sort.Strings(keys)
	tr := &bpeTrainer{tokens: tokens, ids: ids, pairs: map[uint64]int64{}, where: map[uint64][]int32{},
		seen: make([]int, len(keys))}
	for wi, w := range keys {
		var syms []int32
		for _, r := range w {
			syms = append(syms, ids[string(r)])
		}
		tr.words = append(tr.words, syms)
		tr.freq = append(tr.freq, counts[w])
		for i := 0; i+1 < len(syms); i++ {
			k := pairKey(int(syms[i]), int(syms[i+1]))
			tr.pairs[k] += counts[w]
			tr.where[k] = append(tr.where[k], int32(wi))
		}
	}
	tr.queue.tokens = tokens
	for k, n := range tr.pairs {
		tr.queue.items = append(tr.queue.items, pairCount{n: n, a: int32(k >> 32), b: int32(uint32(k))})
	}
	heap.Init(&tr.queue)
	return tr
}

// best returns the most frequent pair and its count (0 when none is left).
func (tr *bpeTrainer) best() (a, b int32, n int64) {
	for tr.queue.Len() > 0 {
		top := tr.queue.items[0]
		cur := tr.pairs[pairKey(int(top.a), int(top.b))]
		if cur == top.n {
			return top.a, top.b, top.n
		}
		// Stale: the count changed since the entry was pushed.
		heap.Pop(&tr.queue)
		if cur > 0 {
			heap.Push(&tr.queue, pairCount{n: cur, a: top.a, b: top.b})
		}
	}
	return 0, 0, 0
}

// merge replaces every occurrence of the pair (a, b) by its merged token.
func (tr *bpeTrainer) merge(a, b int32) {
	tr.rounds++
	s := tr.tokens[a] + tr.tokens[b]
	id, ok := tr.ids[s]
	if !ok {
		id = int32(len(tr.tokens))
		tr.ids[s] = id
		tr.tokens = append(tr.tokens, s)
		tr.queue.tokens = tr.tokens
	}
	key := pairKey(int(a), int(b))
	grown, touched := map[uint64]bool{}, map[uint64]bool{}
	for _, wi := range tr.where[key] {
		if tr.seen[wi] == tr.rounds {
			continue
		}
		tr.seen[wi] = tr.rounds
		w, f := tr.words[wi], tr.freq[wi]
		if !hasPair(w, a, b) {
			continue
		}
		for i := 0; i+1 < len(w); i++ {
			k := pairKey(int(w[i]), int(w[i+1]))
			tr.pairs[k] -= f
			touched[k] = true
		}
		out := w[:0:0]
		for i := 0; i < len(w); i++ {
			if i+1 < len(w) && w[i] == a && w[i+1] == b {
				out = append(out, id)
				i++
			} else {
				out = append(out, w[i])
			}
		}
		tr.words[wi] = out
		for i := 0; i+1 < len(out); i++ {
			k := pairKey(int(out[i]), int(out[i+1]))
			tr.pairs[k] += f
			if out[i] == id || out[i+1] == id {
				tr.where[k] = append(tr.where[k], wi)
				grown[k] = true
			}
		}
	}
	delete(tr.where, key)
	delete(tr.pairs, key)
	for k := range grown {
		if n := tr.pairs[k]; n > 0 {
			heap.Push(&tr.queue, pairCount{n: n, a: int32(k >> 32), b: int32(uint32(k))})
		}
	}
	for k := range touched {
		if tr.pairs[k] <= 0 {
			delete(tr.pairs, k)
			delete(tr.where, k)
		}
	}
}

func hasPair(w []int32, a, b int32) bool {
	for i := 0; i+1 < len(w); i++ {
		if w[i] == a && w[i+1] == b {
			return true
		}
	}
	return false
}

// pairCount is a queued pair with its count when queued.
type pairCount struct {
	n    int64
	a, b int32
}

// pairHeap orders pairs by count, then by their tokens' bytes.
type pairHeap struct {
	items  []pairCount
	tokens []string
}

func (h *pairHeap) Len() int { return len(h.items) }
func (h *pairHeap) Less(i, j int) bool {
	x, y := h.items[i], h.items[j]
	if x.n != y.n {
		return x.n > y.n
	}
	if c := strings.Compare(h.tokens[x.a], h.tokens[y.a]); c != 0 {
		return c < 0
	}
	return h.tokens[x.b] < h.tokens[y.b]
}
func (h *pairHeap) Swap(i, j int) { h.items[i], h.items[j] = h.items[j], h.items[i] }
func (h *pairHeap) Push(x any)    { h.items = append(h.items, x.(pairCount)) }
func (h *pairHeap) Pop() any {
	n := len(h.items) - 1
	x := h.items[n]
	h.items = h.items[:n]
	return x
}

// jsonString is s as a JSON string, with <, > and & as they are.
func jsonString(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.Encode(s) // a string always encodes
	return strings.TrimSuffix(b.String(), "\n")
}

// writeBPE writes tokenizer.json: the vocabulary in id order, one entry a
// line, and the merges as "a b" strings (byte-level tokens hold no space).
func writeBPE(tokens []string, merges [][2]string, o BPEOptions) []byte {
	var b strings.Builder
	b.WriteString("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [")
	for i, s := range o.Special {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "\n    {\"id\": %d, \"content\": %s, \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}",
			i, jsonString(s))
	}
	b.WriteString("\n  ],\n  \"normalizer\": null,\n")
	b.WriteString("  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true},\n")
	if o.BOS != "" {
		bos := jsonString(o.BOS)
		id := indexOf(o.Special, o.BOS)
		fmt.Fprintf(&b, "  \"post_processor\": {\"type\": \"TemplateProcessing\", "+
			"\"single\": [{\"SpecialToken\": {\"id\": %s, \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], "+
			"\"pair\": [{\"SpecialToken\": {\"id\": %s, \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": %s, \"type_id\": 1}}, {\"Sequence\": {\"id\": \"B\", \"type_id\": 1}}], "+
			"\"special_tokens\": {%s: {\"id\": %s, \"ids\": [%d], \"tokens\": [%s]}}},\n", bos, bos, bos, bos, bos, id, bos)
	} else {
		b.WriteString("  \"post_processor\": null,\n")
	}
	b.WriteString("  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n")
	b.WriteString("  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n" +
		"    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": false,\n" +
		"    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {")
	for id, s := range tokens {
		if id > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "\n      %s: %d", jsonString(s), id)
	}
	b.WriteString("\n    },\n    \"merges\": [")
	for i, m := range merges {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "\n      %s", jsonString(m[0]+" "+m[1]))
	}
	b.WriteString("\n    ]\n  }\n}\n")
	return []byte(b.String())
}

func indexOf(xs []string, s string) int {
	for i, x := range xs {
		if x == s {
			return i
		}
	}
	return -1
}

// writeBPEConfig writes tokenizer_config.json: the special tokens by role
// (the first special token that is neither BOS nor EOS pads) for
// transformers' PreTrainedTokenizerFast.
func writeBPEConfig(o BPEOptions) []byte {
	lines := []string{`"tokenizer_class": "PreTrainedTokenizerFast"`, `"clean_up_tokenization_spaces": false`}
	for _, kv := range [][2]string{{"bos_token", o.BOS}, {"eos_token", o.EOS}} {
		if kv[1] != "" {
			lines = append(lines, fmt.Sprintf("%q: %s", kv[0], jsonString(kv[1])))
		}
	}
	for _, s := range o.Special {
		if s != o.BOS && s != o.EOS {
			lines = append(lines, `"pad_token": `+jsonString(s))
			break
		}
	}
	return []byte("{\n  " + strings.Join(lines, ",\n  ") + "\n}\n")
}
