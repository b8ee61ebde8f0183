package tokenizer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/internal/oneline"
)

// File names read by Load.
const (
	TokenizerFile = "tokenizer.json"
	ConfigFile    = "tokenizer_config.json"
	// ChatTemplateFile, when present, holds the chat template in place of
	// the config's chat_template (transformers writes it so since 4.43).
	ChatTemplateFile = "chat_template.jinja"
)

// ErrUnsupported is wrapped by the error Load and Parse return for a
// tokenizer.json component this package does not implement (a Unigram
// model, a split expression with a class intersection, ...).
var ErrUnsupported = errors.New("unsupported")

// ErrUnknownID is wrapped by the error Decode and Stream.Add return for an
// id that names no token.
var ErrUnknownID = errors.New("id names no token")

// Tokenizer encodes text to token ids and back, as the Hugging Face
// tokenizers library does with the same tokenizer.json. It is safe for
// concurrent use.
type Tokenizer struct {
	norm      normalizer   // nil: none
	pre       preTokenizer // nil: none
	model     *bpeModel
	dec       decoder    // nil: tokens joined with spaces
	post      []postStep // applied when special tokens are asked for
	rawAdded  *addedMatcher
	normAdded *addedMatcher
	addedIDs  map[string]int
	tokens    []string // by id
	known     []bool   // by id: tokens[id] is a token
	bos, eos  int
	cleanup   bool
	// scores are the SentencePiece scores of a GGUF vocabulary whose
	// merges were derived from them (FromGGUF); nil otherwise.
	scores []float32
	// maxTokenBytes is MaxTokenBytes: the most input bytes one token
	// stands for, 0 when unbounded.
	maxTokenBytes int
	// special holds the ids of the special added tokens (Special);
	// named the config's named special tokens (SpecialTokens).
	special map[int]bool
	named   map[string]string
	// chatTemplate is ChatTemplate.
	chatTemplate string
}

// Load reads tokenizer.json from dir, and tokenizer_config.json and
// chat_template.jinja if present. A file that is not a regular file (a named pipe, a device) is refused
// before it is opened.
func Load(dir string) (*Tokenizer, error) {
	return load(func(name string) ([]byte, error) {
		return infile.ReadFile(context.Background(), filepath.Join(dir, name))
	}, dir)
}

// LoadFS is Load for the root directory of fsys (an embedded model's,
// say).
func LoadFS(fsys fs.FS) (*Tokenizer, error) {
	return load(func(name string) ([]byte, error) { return infile.ReadFileFS(fsys, name) }, "the file system")
}

func load(read func(name string) ([]byte, error), where string) (*Tokenizer, error) {
	tj, err := read(TokenizerFile)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: read %s: %w", TokenizerFile, err)
	}
	cj, err := read(ConfigFile)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("tokenizer: read %s: %w", ConfigFile, err)
	}
	t, err := Parse(tj, cj)
	if err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, where)
	}
	ct, err := read(ChatTemplateFile)
	switch {
	case err == nil:
		if !utf8.Valid(ct) {
			return nil, fmt.Errorf("tokenizer: %s is not UTF-8 text (in %s)", ChatTemplateFile, where)
		}
		t.chatTemplate = string(ct)
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("tokenizer: read %s: %w", ChatTemplateFile, err)
	}
	return t, nil
}

// specialKeys are the config's named special tokens, in the order
// transformers adds them.
var specialKeys = []string{"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}

// configFile is the part of tokenizer_config.json this package reads; the
// special token names are read by key.
type configFile struct {
	AddBOS             *bool                     `json:"add_bos_token"`
	AddEOS             *bool                     `json:"add_eos_token"`
	CleanUp            *bool                     `json:"clean_up_tokenization_spaces"`
	CleanUpBPE         *bool                     `json:"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"`
	AddedTokensDecoder map[string]addedTokenJSON `json:"added_tokens_decoder"`
	ChatTemplate       json.RawMessage           `json:"chat_template"`
}

// tokenName reads a special token given as a string or as an AddedToken
// object with "content"; "" when absent or null.
func tokenName(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var o struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &o); err != nil {
		return "", fmt.Errorf("special token %s is neither a string nor an object with content", oneline.JSON(raw))
	}
	return o.Content, nil
}

// tokenNames reads a list of special tokens (strings or objects with
// content) or a map from names to them, as additional_special_tokens and
// extra_special_tokens are written.
func tokenNames(raw json.RawMessage) ([]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, errors.New("neither a list nor a map of tokens")
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			list = append(list, m[k])
		}
	}
	var out []string
	for _, r := range list {
		n, err := tokenName(r)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// Parse builds a Tokenizer from the contents of tokenizer.json and, if not
// nil, tokenizer_config.json.
func Parse(tokenizerJSON, configJSON []byte) (*Tokenizer, error) {
	t, err := parse(tokenizerJSON, configJSON)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	return t, nil
}

// maxTokenIDs bounds the id space a tokenizer.json may declare: well above
// any real vocabulary (a few hundred thousand tokens), low enough that the
// id tables stay small whatever ids a file names.
const maxTokenIDs = 1 << 24

func parse(tokenizerJSON, configJSON []byte) (*Tokenizer, error) {
	var f tokenizerFile
	if err := json.Unmarshal(tokenizerJSON, &f); err != nil {
		return nil, fmt.Errorf("%s: %v", TokenizerFile, err)
	}
	var cfg configFile
	var cfgKeys map[string]json.RawMessage
	if len(configJSON) > 0 {
		if err := json.Unmarshal(configJSON, &cfg); err != nil {
			return nil, fmt.Errorf("%s: %v", ConfigFile, err)
		}
		if err := json.Unmarshal(configJSON, &cfgKeys); err != nil {
			return nil, fmt.Errorf("%s: %v", ConfigFile, err)
		}
	}
	t := &Tokenizer{bos: -1, eos: -1}
	if err := t.parseComponents(&f); err != nil {
		return nil, fmt.Errorf("%s: %w", TokenizerFile, err)
	}
	added, names, err := t.collectAdded(&f, &cfg, cfgKeys)
	if err != nil {
		return nil, err
	}
	t.setAdded(added)
	t.maxTokenBytes = t.tokenSpan(added)
	t.named = map[string]string{}
	for k, n := range names {
		if n != "" {
			t.named[k] = n
		}
	}
	if t.chatTemplate, err = chatTemplate(cfg.ChatTemplate); err != nil {
		return nil, fmt.Errorf("%s: chat_template: %v", ConfigFile, err)
	}

	// The id space: model vocabulary, overridden by added tokens.
	size := 0
	for _, id := range t.model.vocab {
		size = max(size, id+1)
	}
	for _, a := range added {
		size = max(size, a.id+1)
	}
	if size > maxTokenIDs { // before sizing the tables by an id from the file
		return nil, fmt.Errorf("%s: token id %d is beyond the largest supported, %d", TokenizerFile, size-1, maxTokenIDs-1)
	}
	t.tokens = make([]string, size)
	t.known = make([]bool, size)
	for tok, id := range t.model.vocab {
		t.tokens[id], t.known[id] = tok, true
	}
	for _, a := range added {
		t.tokens[a.id], t.known[a.id] = a.content, true
	}

	for _, step := range t.post {
		for _, item := range step {
			for _, id := range item {
				if id < 0 || id >= size || !t.known[id] {
					return nil, fmt.Errorf("%s: post_processor adds id %d, which names no token", TokenizerFile, id)
				}
			}
		}
	}
	if n := names["bos_token"]; n != "" {
		t.bos = t.lookup(n)
	} else if len(t.post) > 0 && len(t.post[0]) > 0 && len(t.post[0][0]) > 0 {
		t.bos = t.post[0][0][0]
	}
	if n := names["eos_token"]; n != "" {
		t.eos = t.lookup(n)
	}
	if cfg.AddBOS != nil || cfg.AddEOS != nil {
		t.overrideTemplate(cfg.AddBOS, cfg.AddEOS)
	}
	// transformers (5.x) ignores clean_up_tokenization_spaces for BPE models
	// unless the config insists with a second flag; all models here are BPE.
	t.cleanup = cfg.CleanUp != nil && *cfg.CleanUp && cfg.CleanUpBPE != nil && *cfg.CleanUpBPE
	return t, nil
}

// parseComponents reads the model and the pipeline steps of tokenizer.json.
func (t *Tokenizer) parseComponents(f *tokenizerFile) error {
	if isNull(f.Model) {
		return errors.New("no model")
	}
	var err error
	if t.model, err = parseModel(f.Model); err != nil {
		return err
	}
	if !isNull(f.Normalizer) {
		if t.norm, err = parseNormalizer(f.Normalizer); err != nil {
			return err
		}
	}
	if !isNull(f.PreTokenizer) {
		if t.pre, err = parsePreTokenizer(f.PreTokenizer); err != nil {
			return err
		}
	}
	if !isNull(f.Decoder) {
		if t.dec, err = parseDecoder(f.Decoder); err != nil {
			return err
		}
	}
	if !isNull(f.PostProcessor) {
		if t.post, err = parsePostProcessor(f.PostProcessor); err != nil {
			return err
		}
	}
	return nil
}

// collectAdded returns the added tokens: those of tokenizer.json, then those
// that the config's added_tokens_decoder and special token names add, as
// transformers does; and the config's named special tokens.
func (t *Tokenizer) collectAdded(f *tokenizerFile, cfg *configFile, cfgKeys map[string]json.RawMessage) ([]addedToken, map[string]string, error) {
	var added []addedToken
	seen := map[string]bool{}
	for i, a := range f.AddedTokens {
		if a.ID == nil || *a.ID < 0 {
			return nil, nil, fmt.Errorf("%s: added token %d (%q) has no valid id", TokenizerFile, i, a.Content)
		}
		if a.Content == "" || seen[a.Content] {
			continue
		}
		seen[a.Content] = true
		added = append(added, a.token(*a.ID))
	}
	var keys []string
	for k := range cfg.AddedTokensDecoder {
		keys = append(keys, k)
	}
	for _, k := range sortedNumeric(keys) {
		a := cfg.AddedTokensDecoder[k]
		id, err := strconv.Atoi(k)
		if err != nil || id < 0 {
			return nil, nil, fmt.Errorf("%s: added_tokens_decoder key %q is not an id", ConfigFile, k)
		}
		if a.Content == "" || seen[a.Content] {
			continue
		}
		seen[a.Content] = true
		added = append(added, a.token(id))
	}

	names := map[string]string{}
	var special []string
	for _, key := range specialKeys {
		n, err := tokenName(cfgKeys[key])
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %s: %v", ConfigFile, key, err)
		}
		names[key] = n
		special = append(special, n)
	}
	for _, key := range []string{"additional_special_tokens", "extra_special_tokens"} {
		ns, err := tokenNames(cfgKeys[key])
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %s: %v", ConfigFile, key, err)
		}
		special = append(special, ns...)
	}
	// A special token the config names that is not an added token yet
	// becomes one, with its vocabulary id or else the next free id.
	nextID := len(t.model.vocab)
	for _, a := range added {
		nextID = max(nextID, a.id+1)
	}
	for _, n := range special {
		if n == "" || seen[n] {
			continue
		}
		seen[n] = true
		id, ok := t.model.vocab[n]
		if !ok {
			id = nextID
			nextID++
		}
		added = append(added, addedToken{id: id, content: n, special: true})
	}
	return added, names, nil
}

// setAdded builds the two added-token matchers: one for tokens matched in
// the raw text, one for tokens matched after normalization.
func (t *Tokenizer) setAdded(added []addedToken) {
	var raw, norm []addedToken
	var rawPat, normPat []string
	t.addedIDs = make(map[string]int, len(added))
	for _, a := range sortedAdded(added) {
		t.addedIDs[a.content] = a.id
		if a.normalized {
			p := a.content
			if t.norm != nil {
				p = t.norm.normalize(p)
			}
			norm, normPat = append(norm, a), append(normPat, p)
		} else {
			raw, rawPat = append(raw, a), append(rawPat, a.content)
		}
	}
	t.rawAdded = newAddedMatcher(raw, rawPat)
	t.normAdded = newAddedMatcher(norm, normPat)
	t.special = map[int]bool{}
	for _, a := range added {
		if a.special {
			t.special[a.id] = true
		}
	}
}

// lookup returns the id of a token, added tokens first, or -1.
func (t *Tokenizer) lookup(tok string) int {
	if id, ok := t.addedIDs[tok]; ok {
		return id
	}
	if id, ok := t.model.vocab[tok]; ok {
		return id
	}
	return -1
}

// overrideTemplate replaces the post-processor with [BOS] text [EOS] when
// the config sets add_bos_token or add_eos_token, as transformers does: a
// flag left out counts as false, and one naming a token the tokenizer lacks
// is dropped.
func (t *Tokenizer) overrideTemplate(addBOS, addEOS *bool) {
	step := postStep{nil}
	if addBOS != nil && *addBOS && t.bos >= 0 {
		step = append(postStep{{t.bos}}, step...)
	}
	if addEOS != nil && *addEOS && t.eos >= 0 {
		step = append(step, []int{t.eos})
	}
	t.post = []postStep{step}
}

func (t *Tokenizer) applyPost(ids []int) []int {
	for _, s := range t.post {
		ids = s.apply(ids)
	}
	return ids
}

// Encode returns the token ids of text. With addSpecial it adds the special
// tokens (BOS and the like) that the tokenizer's post-processor, or the
// config's add_bos_token/add_eos_token, call for: Hugging Face's
// add_special_tokens=True. Text must be valid UTF-8.
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]int, error) {
	if !utf8.ValidString(text) {
		return nil, errors.New("tokenizer: encode: text is not valid UTF-8")
	}
	var ps []piece
	if text != "" {
		ps = t.rawAdded.split(piece{text: text, id: -1, first: true}, nil)
	}
	if t.norm != nil || len(t.normAdded.tokens) > 0 {
		next := make([]piece, 0, len(ps))
		for _, p := range ps {
			if p.id >= 0 {
				next = append(next, p)
				continue
			}
			if t.norm != nil {
				p.text = t.norm.normalize(p.text)
			}
			if p.text != "" {
				next = t.normAdded.split(p, next)
			}
		}
		ps = next
	}
	ids := make([]int, 0, len(text)/3+4)
	var err error
	var buf []byte
	word := func(p piece) {
		if err != nil {
			return
		}
		if p.byteLevel {
			buf = appendByteLevel(buf[:0], p.text)
			ids, err = t.model.encodeBytes(ids, buf, "")
		} else {
			ids, err = t.model.encode(ids, p.text)
		}
	}
	for _, p := range ps {
		switch {
		case p.id >= 0:
			ids = append(ids, p.id)
		case t.pre != nil:
			t.pre.preTokenize(p, word)
		default:
			word(p)
		}
	}
	if err != nil {
		return nil, err
	}
	if addSpecial {
		ids = t.applyPost(ids)
	}
	return ids, nil
}

// token returns the string of an id.
func (t *Tokenizer) token(id int) (string, error) {
	if id < 0 || id >= len(t.tokens) || !t.known[id] {
		return "", fmt.Errorf("tokenizer: decode: %w: %d (vocabulary size %d)", ErrUnknownID, id, len(t.tokens))
	}
	return t.tokens[id], nil
}

// Decode returns the text of ids, special tokens included, as Hugging
// Face's decode(ids) does. An id that names no token is an error.
func (t *Tokenizer) Decode(ids []int) (string, error) {
	toks := make([]string, len(ids))
	for i, id := range ids {
		s, err := t.token(id)
		if err != nil {
			return "", err
		}
		toks[i] = s
	}
	var s string
	if t.dec == nil {
		s = strings.Join(toks, " ")
	} else {
		s = strings.Join(t.dec.decodeChain(toks), "")
	}
	if t.cleanup {
		s = cleanupSpaces(s)
	}
	return s, nil
}

// VocabSize returns the size of the id space: one more than the largest id
// of the model vocabulary and the added tokens.
func (t *Tokenizer) VocabSize() int { return len(t.tokens) }

// BOS returns the id of the beginning-of-sequence token, or -1 if none: the
// config's bos_token, else the first token the post-processor adds.
func (t *Tokenizer) BOS() int { return t.bos }

// EOS returns the id of the config's eos_token, or -1 if none.
func (t *Tokenizer) EOS() int { return t.eos }

// Token returns the string of the token with the given id, as stored in the
// vocabulary (byte-level and ▁ characters included).
func (t *Tokenizer) Token(id int) (string, bool) {
	if id < 0 || id >= len(t.tokens) || !t.known[id] {
		return "", false
	}
	return t.tokens[id], true
}

// ID returns the id of a token string (added tokens first), or -1.
func (t *Tokenizer) ID(token string) int { return t.lookup(token) }

// Stream decodes ids one at a time, for printing generated text as it comes.
// Concatenating everything Add returns and then Flush gives exactly
// Decode(ids). Text is held back while it may still change: an incomplete
// UTF-8 sequence, a run of byte-fallback tokens (whose bytes decode together
// or not at all), spaces a Strip decoder may yet remove. A Stream is not
// safe for concurrent use.
type Stream struct {
	t    *Tokenizer
	head sink
	out  *collector
}

// NewStream returns a Stream that starts a new sequence.
func (t *Tokenizer) NewStream() *Stream {
	s := &Stream{t: t, out: &collector{}}
	var next sink = s.out
	if t.cleanup {
		next = &cleanupStage{next: next}
	}
	if t.dec == nil {
		next = &spaceJoinStage{next: next}
	} else {
		next = t.dec.stage(next)
	}
	s.head = next
	return s
}

// Add decodes one more id and returns the text it completes, which may be
// empty.
func (s *Stream) Add(id int) (string, error) {
	tok, err := s.t.token(id)
	if err != nil {
		return "", err
	}
	s.head.token(tok)
	return s.out.take(), nil
}

// Flush returns the text still held back and ends the sequence; the Stream
// can then start another.
func (s *Stream) Flush() string {
	s.head.flush()
	return s.out.take()
}
