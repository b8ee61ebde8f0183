package loader

import (
	"errors"

	"github.com/strata-llm/strata/loader/tokenizer"
)

// The tokenizer of a GGUF file: its tokenizer.ggml.* metadata, read into
// and written from a tokenizer.GGUFVocab.

// GGUFVocab reads the tokenizer a GGUF file's metadata holds; ok is false
// when it holds none (no tokenizer.ggml.tokens, or the model "none"). Keys
// left out take llama.cpp's defaults: for the llama kind BOS 1, EOS 2 and
// the unknown token 0 (when there are so many tokens), add_bos_token and
// add_space_prefix true; for the gpt2 kind no special tokens, and
// add_bos_token true only for Llama 3's pre-tokenizer. The chat template
// is tokenizer.chat_template.
func GGUFVocab(md *GGUFMetadata) (v *tokenizer.GGUFVocab, ok bool, err error) {
	v, ok, err = ggufVocab(md)
	if err == nil && ok {
		// Read here, not by ggufVocab: the config's special ids do not
		// depend on it.
		if v.ChatTemplate, err = md.String("tokenizer.chat_template"); errors.Is(err, ErrNoKey) {
			err = nil
		}
	}
	if err != nil {
		return nil, false, &fileError{file: md.file, kind: ErrFormat, msg: "tokenizer: " + trimLoader(err)}
	}
	return v, ok, nil
}

// trimLoader is an error's text without the prefix of a loader error
// naming the same file.
func trimLoader(err error) string {
	var fe *fileError
	if errors.As(err, &fe) && fe.tensor == "" {
		return fe.msg
	}
	return err.Error()
}

func ggufVocab(md *GGUFMetadata) (*tokenizer.GGUFVocab, bool, error) {
	const p = "tokenizer.ggml."
	if _, ok := md.Get(p + "tokens"); !ok {
		return nil, false, nil
	}
	model, err := md.String(p + "model")
	if err != nil {
		return nil, false, err
	}
	if model == "none" || model == "no_vocab" {
		return nil, false, nil
	}
	v := &tokenizer.GGUFVocab{Model: model, BOS: -1, EOS: -1, UNK: -1}
	if v.Tokens, err = md.Strings(p + "tokens"); err != nil {
		return nil, false, err
	}
	n := len(v.Tokens)
	if pre, err := md.String(p + "pre"); err == nil {
		v.Pre = pre
	} else if !errors.Is(err, ErrNoKey) {
		return nil, false, err
	}
	if _, ok := md.Get(p + "scores"); ok {
		if v.Scores, err = md.Float32s(p + "scores"); err != nil {
			ints, ierr := md.Ints(p + "scores") // llama.cpp takes int32 scores too
			if ierr != nil {
				return nil, false, err
			}
			v.Scores = make([]float32, len(ints))
			for i, x := range ints {
				v.Scores[i] = float32(x)
			}
		}
	}
	if _, ok := md.Get(p + "token_type"); ok {
		types, err := md.Ints(p + "token_type")
		if err != nil {
			return nil, false, err
		}
		v.Types = make([]int32, len(types))
		for i, x := range types {
			v.Types[i] = int32(max(min(x, 1<<30), -1<<30))
		}
	}
	if _, ok := md.Get(p + "merges"); ok {
		if v.Merges, err = md.Strings(p + "merges"); err != nil {
			return nil, false, err
		}
	}
	// llama.cpp's arrays may be longer than the token list; not shorter.
	if v.Scores != nil {
		if len(v.Scores) < n {
			return nil, false, md.keyErr(p+"scores", ErrFormat, "%d scores for %d tokens", len(v.Scores), n)
		}
		v.Scores = v.Scores[:n]
	}
	if v.Types != nil {
		if len(v.Types) < n {
			return nil, false, md.keyErr(p+"token_type", ErrFormat, "%d token types for %d tokens", len(v.Types), n)
		}
		v.Types = v.Types[:n]
	}

	if model == "llama" {
		v.AddBOS, v.AddSpacePrefix = true, true
		for _, d := range []struct {
			dst *int
			id  int
		}{{&v.BOS, 1}, {&v.EOS, 2}, {&v.UNK, 0}} {
			if d.id < n {
				*d.dst = d.id
			}
		}
	}
	switch v.Pre {
	case "llama-bpe", "llama3", "llama-v3":
		v.AddBOS = true
	}
	for _, d := range []struct {
		key string
		dst *int
	}{{"bos_token_id", &v.BOS}, {"eos_token_id", &v.EOS}, {"unknown_token_id", &v.UNK}} {
		id, err := md.Uint(p + d.key)
		switch {
		case errors.Is(err, ErrNoKey):
			continue
		case err != nil:
			return nil, false, err
		case id >= uint64(n):
			return nil, false, md.keyErr(p+d.key, ErrFormat, "token %d is outside the %d tokens", id, n)
		}
		*d.dst = int(id)
	}
	for _, d := range []struct {
		key string
		dst *bool
	}{{"add_bos_token", &v.AddBOS}, {"add_eos_token", &v.AddEOS}, {"add_space_prefix", &v.AddSpacePrefix}} {
		b, err := md.Bool(p + d.key)
		switch {
		case errors.Is(err, ErrNoKey):
		case err != nil:
			return nil, false, err
		default:
			*d.dst = b
		}
	}
	return v, true, nil
}

// GGUFTokenizerKVs returns the tokenizer.ggml.* metadata of v, typed as
// llama.cpp's converter writes it (uint32 ids, int32 token types, float32
// scores).
func GGUFTokenizerKVs(v *tokenizer.GGUFVocab) []GGUFKV {
	const p = "tokenizer.ggml."
	kvs := []GGUFKV{{p + "model", v.Model}}
	if v.Model == "gpt2" {
		kvs = append(kvs, GGUFKV{p + "pre", v.Pre})
	}
	kvs = append(kvs, GGUFKV{p + "tokens", GGUFArray{GGUFTypeString, v.Tokens}})
	if v.Scores != nil {
		kvs = append(kvs, GGUFKV{p + "scores", GGUFArray{GGUFTypeFloat32, v.Scores}})
	}
	if v.Types != nil {
		kvs = append(kvs, GGUFKV{p + "token_type", GGUFArray{GGUFTypeInt32, v.Types}})
	}
	if v.Merges != nil {
		kvs = append(kvs, GGUFKV{p + "merges", GGUFArray{GGUFTypeString, v.Merges}})
	}
	for _, id := range []struct {
		key string
		id  int
	}{{"bos_token_id", v.BOS}, {"eos_token_id", v.EOS}, {"unknown_token_id", v.UNK}} {
		if id.id >= 0 {
			kvs = append(kvs, GGUFKV{p + id.key, uint32(id.id)})
		}
	}
	kvs = append(kvs, GGUFKV{p + "add_bos_token", v.AddBOS}, GGUFKV{p + "add_eos_token", v.AddEOS})
	if v.Model == "llama" {
		kvs = append(kvs, GGUFKV{p + "add_space_prefix", v.AddSpacePrefix})
	}
	if v.ChatTemplate != "" {
		kvs = append(kvs, GGUFKV{"tokenizer.chat_template", v.ChatTemplate})
	}
	return kvs
}

// ggufTokenizer builds the tokenizer of a GGUF file, nil when it has none.
func ggufTokenizer(md *GGUFMetadata) (*tokenizer.Tokenizer, error) {
	v, ok, err := GGUFVocab(md)
	if err != nil || !ok {
		return nil, err
	}
	tok, err := tokenizer.FromGGUF(v)
	if err != nil {
		return nil, &fileError{file: md.file, kind: ErrFormat, msg: err.Error()}
	}
	return tok, nil
}

// mergeKVs returns kvs with every key of more replaced by more's value or
// added at the end.
func mergeKVs(kvs []GGUFKV, more ...GGUFKV) []GGUFKV {
	at := make(map[string]int, len(kvs))
	for i, kv := range kvs {
		at[kv.Key] = i
	}
	for _, kv := range more {
		if i, ok := at[kv.Key]; ok {
			kvs[i] = kv
			continue
		}
		at[kv.Key] = len(kvs)
		kvs = append(kvs, kv)
	}
	return kvs
}
