// Command finetune fine-tunes a Llama-family model on a text file, on the
// GPU or the CPU, with mixed precision (the stored F16/BF16 weights with an
// F32 master copy and a dynamic loss scale), recompute checkpoints and,
// optionally, its weights paged under a memory budget.
//
//	go run ./examples/finetune [-model DIR] -data FILE.txt [-steps N] [-lr X]
//	    [-optimizer adamw|sgd] [-seq-len N] [-checkpoint-segments K]
//	    [-device cpu|cuda|auto] [-gpu-memory-limit SIZE]
//	    [-grads-out FILE -ids 1,2,3] [-save DIR] [-cpuprofile FILE]
//
// The text is encoded with the model's tokenizer and cut into windows of
// -seq-len tokens; each step trains on the next window (mean next-token
// cross-entropy). Each step's loss is printed on stdout, with a progress bar
// on stderr. -save writes a Hugging Face checkpoint (the stored dtype, the
// source's config and tokenizer) that examples/generate and transformers
// load; its directory is checked before training, and an earlier
// checkpoint there is replaced only once the new one is complete. -grads-out writes the loss and grad.<parameter name> (F32) of one
// step on -ids at the initial weights, as the fixtures' grads.safetensors;
// without -data nothing is trained.
//
// The forward and the backward run on the -device (cuda when the build has
// the cuda tag and a GPU exists, else the CPU); the optimizer updates the
// F32 master weights on the host, where every layer's gradients arrive as
// the backward finishes it. On a GPU the weights are uploaded for every step
// (an update makes the device's copies stale), all of them when no
// -gpu-memory-limit is given (nine tenths of the free memory is the budget),
// else paged under it.
//
// Without -model it trains the default model embedded in the binary
// (examples/internal/defaultmodel).
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error.
package main

import (
	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/examples/internal/cli"
)

func main() { cli.Main("finetune", run) }
