package nn

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader"
)

// Save writes the parameters as a Hugging Face checkpoint into dir: the
// working copies (the stored dtype, so the config's dtype still holds) in
// model.safetensors, or in shards of at most maxShardBytes with
// model.safetensors.index.json when they add up to more (maxShardBytes <= 0
// means one file), and config.json, generation_config.json and the tokenizer
// files copied from the model from (the one the parameters were read
// from). With tied embeddings only model.embed_tokens.weight is written.
// Weights holding a NaN or an infinity are an error wrapping ErrNonFinite
// (see CheckFinite), found before anything is written.
//
// The checkpoint is written as a whole (loader.ReplaceModelDir): an earlier
// checkpoint in dir is replaced only once the new one is complete, and a
// failure (a full disk, a cancelled ctx) leaves dir as it was. dir must
// pass CheckSaveDir.
func (p *Params) Save(ctx context.Context, dir string, from *loader.Model, maxShardBytes int64) error {
	if err := p.CheckFinite(); err != nil {
		return fmt.Errorf("nn: save: %w; nothing was written", err)
	}
	if err := CheckSaveDir(dir, from); err != nil {
		return err
	}
	src := from.FS()
	return loader.ReplaceModelDir(dir, func(tmp string) error {
		for _, name := range loader.ModelFiles {
			data, err := infile.ReadFileFS(src, name)
			if errors.Is(err, fs.ErrNotExist) && name != loader.ConfigFile {
				continue
			}
			if err == nil {
				err = atomicfile.WriteFile(filepath.Join(tmp, name), data)
			}
			if err != nil {
				return fmt.Errorf("nn: save: %s: %w", name, err)
			}
		}
		w := loader.NewShardedWriter(tmp, max(maxShardBytes, 0))
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
	})
}

// CheckSaveDir reports whether Save can write a checkpoint of a model read
// from from into dir, so that a trainer finds out before it trains: dir is
// not a file; its parent directory exists and accepts new entries; it is
// new, empty or holds nothing but a model's files (loader.CheckModelDir);
// and it is neither from's directory nor inside it.
func CheckSaveDir(dir string, from *loader.Model) error {
	if err := atomicfile.CheckDir("nn: save:", dir); err != nil {
		return err
	}
	if err := notInside(dir, from); err != nil {
		return err
	}
	if _, err := loader.CheckModelDir(dir); err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	return nil
}

// notInside refuses a dir that is from's directory or inside it, through
// any path or link.
func notInside(dir string, from *loader.Model) error {
	if from.InputFiles() == nil {
		return nil // not read from disk
	}
	src, err := os.Stat(from.Dir)
	if err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("nn: save: %w", err)
	}
	for p := abs; ; p = filepath.Dir(p) {
		if st, err := os.Stat(p); err == nil && os.SameFile(st, src) {
			if p == abs {
				return fmt.Errorf("nn: save: %s is the directory the model was read from", dir)
			}
			return fmt.Errorf("nn: save: %s is inside %s, the directory the model was read from", dir, from.Dir)
		}
		if filepath.Dir(p) == p {
			return nil
		}
	}
}
