// Package defaultmodel embeds strata's small default model, which
// examples/generate, serve and finetune run when no -model is given: a
// Llama-family model trained from scratch by examples/train on Debian's
// fortunes and the Jargon File (examples/train/recipe.sh rebuilds it;
// examples/train/CORPUS.md says what the texts are and their licenses).
//
// The directory Name holds the model as examples/train -save writes it:
// config.json, F16 safetensors in shards of under 2 MB with their index,
// tokenizer.json and tokenizer_config.json. The random-weight checkpoints of
// loader/fixtures stay the test references; this model is for people.
//
//	lm, err := defaultmodel.Open()
package defaultmodel

import (
	"embed"
	"io/fs"

	"github.com/strata-llm/strata/loader"
)

// Name is the model's directory and its id in examples/serve's API.
const Name = "strata-fortunes"

//go:embed strata-fortunes
var files embed.FS

// FS returns the embedded files: one directory, Name.
func FS() fs.FS { return files }

// Open opens the embedded model in place: nothing is written to disk.
func Open() (*loader.Model, error) { return loader.OpenFS(files, Name) }
