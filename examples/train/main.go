// Command train trains a Llama-family model from its initial weights (a
// random initialisation written by examples/synth) on a text corpus: the
// from-scratch counterpart of examples/finetune, with batches, a cosine
// learning-rate schedule, held-out perplexity, checkpoints and a loss log.
// recipe.sh beside it builds strata's small default model with it.
//
//	go run ./examples/train -model INIT -data train.jsonl [-eval heldout.jsonl]
//	    [-steps N] [-batch B] [-seq-len T] [-lr X] [-min-lr X] [-warmup N]
//	    [-weight-decay X] [-checkpoint-segments K] [-device cpu|cuda|auto]
//	    [-eval-every N] [-eval-tokens N] [-save DIR] [-save-every N]
//	    [-log FILE.jsonl] [-prompt TEXT] [-seed S] [-duration D] [-shard-bytes N]
//
// Every document (a {"text": ...} line of a .jsonl file; any other file is
// one document) is encoded with the model's tokenizer as BOS, text, EOS,
// and the documents are joined into one stream cut into windows of
// -seq-len + 1 tokens. Each epoch visits the windows in an order drawn
// from -seed; a step adds up the gradients of -batch windows (the mean
// next-token cross-entropy of each) with the dynamic loss scale, unscales
// and clips them, and makes one AdamW update at the step's learning rate:
// linear warm-up over -warmup steps to -lr, then a cosine down to -min-lr
// at -steps.
//
// Every -eval-every steps and at the end it prints the mean cross-entropy
// of the held-out documents (at most -eval-tokens of them) and its
// perplexity next to the uniform baseline (the vocabulary size), and a
// sampled continuation of -prompt. -save writes the model (the stored
// dtype, config and tokenizer of -model, in safetensors files of at most
// -shard-bytes) every -save-every steps and at the end, each checkpoint
// replacing the last once complete; -log rewrites the loss log as it goes:
// a JSON object a line, {"step", "tokens", "seconds", "lr", "loss",
// "scale", "grad_norm"} for every step and {"step", ..., "heldout_loss",
// "heldout_ppl", "heldout_tokens"} for every evaluation (examples/train/plot
// draws it). -duration ends the run after that much training time, at
// most -steps: the learning rate's cosine then follows the time.
//
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error.
package main

import (
	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/examples/internal/cli"
)

func main() { cli.Main("train", run) }
