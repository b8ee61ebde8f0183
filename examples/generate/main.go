// Command generate runs a Llama-family model from a Hugging Face directory:
// it streams generated text (or ids) to stdout, with a progress bar on stderr
// while weights load.
//
//	go run ./examples/generate [-model DIR] [-prompt TEXT | -ids 1,2,3]
//	    [-max-new-tokens N] [-temperature T] [-top-k K] [-top-p P] [-seed S]
//	    [-device cpu|cuda|auto] [-json] [-logits-out FILE]
//
// Without -model it runs the default model embedded in the binary
// (examples/internal/defaultmodel).
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error, with
// one line on stderr naming the problem.
package main

import (
	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/examples/internal/cli"
)

func main() { cli.Main("generate", run) }
