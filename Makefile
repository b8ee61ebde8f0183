# strata: make run (generate on the embedded default model), make test.
GO       ?= go
BENCHTIME ?= 1x

.PHONY: run test test-race bench bench-gpu lint synth train-gpu

# run: the embedded default model (examples/internal/defaultmodel) continues
# a prompt, greedily.
run:
	$(GO) run ./examples/generate -prompt "The secret of life is" -max-new-tokens 24

test:
	CGO_ENABLED=0 $(GO) build ./...
	$(GO) vet ./...
	$(GO) test -count=1 ./...

test-race:
	$(GO) test -race -count=1 ./...

bench:
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) ./tensor/ ./loader/ ./nn/ ./paging/

# lint also refuses a tracked file over 2 MB outside a testdata directory:
# build outputs and models do not belong in git.
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@big=$$(git ls-files -z | xargs -0 -r stat -c '%s %n' 2>/dev/null | awk '$$1 > 2097152 && $$2 !~ /(^|\/)testdata\//'); \
		if [ -n "$$big" ]; then echo "tracked files over 2 MB outside testdata:"; echo "$$big"; exit 1; fi
	$(GO) vet ./...

synth:
	$(GO) run ./examples/synth -out /tmp/strata-synth -preset tinyllama-1.1b

# bench-gpu builds what examples/bench/run-gpu.sh needs on a GPU machine with
# no Go: the cuda builds of bench and synth, and the GPU test binaries.
bench-gpu: cuda-deps cuda-test-bin
	CGO_ENABLED=1 $(GO) build -tags cuda -ldflags="-s -w" -o bin/bench ./examples/bench
	CGO_ENABLED=1 $(GO) build -tags cuda -ldflags="-s -w" -o bin/generate ./examples/generate
	CGO_ENABLED=1 $(GO) build -ldflags="-s -w" -o bin/synth ./examples/synth
	@echo "copy the repository with bin/ to the GPU machine, then run there:"
	@echo "  OUT=bench-out examples/bench/run-gpu.sh"

# train-gpu prepares what examples/train/run-gpu.sh needs on a GPU machine
# with no Go: the corpus, tokenizer and initial model in first-run/ (see
# examples/train/recipe.sh) and the cuda build of the trainer in bin/.
train-gpu: cuda-deps
	STAGE=prepare examples/train/recipe.sh first-run
	CGO_ENABLED=1 $(GO) build -tags cuda -ldflags="-s -w" -o bin/train ./examples/train
	@echo "carry bin/train, first-run/data and first-run/init to the GPU machine, then run there:"
	@echo "  OUT=out examples/train/run-gpu.sh first-run"

include cuda/Makefile.inc
include fuzz.mk bench.mk
