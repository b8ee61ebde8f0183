// Command serve answers OpenAI's completion and chat APIs with a
// Llama-family model run by strata's engine: requests go through an
// engine.Batcher, which runs several at once within the memory budgets.
//
//	go run ./examples/serve [-model DIR|FILE.gguf] [-addr 127.0.0.1:8080]
//	    [-max-sequences N] [-max-queue N] [-context N] [-drain-timeout D]
//	    [the memory and device flags of generate, or their -config file]
//
// Endpoints: POST /v1/completions and /v1/chat/completions (whole, or
// "stream": true as server-sent events ending with "data: [DONE]"), GET
// /v1/models, GET /health and GET /metrics (Prometheus' text format).
// The first SIGINT or SIGTERM stops taking requests and lets the running
// ones finish (within -drain-timeout), then serve exits; a second one ends
// it at once. Without -model it serves the default model embedded in the
// binary (examples/internal/defaultmodel). Exit status: 0 after a drain, 2 for a bad flag, 1 for any
// other error, with one line on stderr naming the problem.
package main

import (
	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/examples/internal/cli"
)

func main() { cli.Main("serve", run) }
