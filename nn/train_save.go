package nn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"

	"github.com/strata-llm/strata/loader"
)

// Files of a Hugging Face model directory that Save copies from the source
// model when they exist: the config (required) and the tokenizer.
var saveCopies = []string{
	loader.ConfigFile, "generation_config.json",
	"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
}

// shardFile matches the weight files of a Hugging Face checkpoint.
var shardFile = regexp.MustCompile(`^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$`)

// Save writes the parameters as a Hugging Face checkpoint into dir: the
// working copies (the stored dtype, so the config's dtype still holds) in
// model.safetensors, or in shards of at most maxShardBytes with
// model.safetensors.index.json when they add up to more (maxShardBytes <= 0
// means one file), and config.json, generation_config.json and the tokenizer
// files copied from the model directory from. With tied embeddings only
// model.embed_tokens.weight is written. Weight files of an earlier
// checkpoint in dir are removed first; dir may not be from itself.
// Weights holding a NaN or an infinity are an error wrapping ErrNonFinite
// (see CheckFinite), found before anything is written.
func (p *Params) Save(ctx context.Context, dir, from string, maxShardBytes int64) error {
	if err := p.CheckFinite(); err != nil {
		return fmt.Errorf("nn: save: %w; nothing was written", err)
	}
	if same, err := sameDir(dir, from); err != nil {
		return fmt.Errorf("nn: save: %w", err)
	} else if same {
		return fmt.Errorf("nn: save: %s is the directory the model was read from", dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	for _, name := range saveCopies {
		err := copyFile(filepath.Join(dir, name), filepath.Join(from, name))
		if errors.Is(err, fs.ErrNotExist) && name != loader.ConfigFile {
			continue
		}
		if err != nil {
			return fmt.Errorf("nn: save: %w", err)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	for _, e := range entries {
		if shardFile.MatchString(e.Name()) {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return fmt.Errorf("nn: save: %w", err)
			}
		}
	}
	w := loader.NewShardedWriter(dir, max(maxShardBytes, 0))
	w.Metadata = map[string]string{"format": "pt"}
	for _, name := range p.names {
		if err := w.AddTensor(name, p.byName[name].work); err != nil {
			return fmt.Errorf("nn: save: %w", err)
		}
	}
	if _, err := w.Write(ctx); err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	return nil
}

// sameDir reports whether a and b name one existing directory.
func sameDir(a, b string) (bool, error) {
	sa, err := os.Stat(a)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	sb, err := os.Stat(b)
	if err != nil {
		return false, err
	}
	return os.SameFile(sa, sb), nil
}

func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
