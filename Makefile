# strata: make run (generate on the embedded default model), make test.
GO       ?= go
BENCHTIME ?= 1x

.PHONY: run test test-race bench lint synth fuzz

run:
	$(GO) run ./examples/generate -prompt "Hello, world!" -max-new-tokens 24

test:
	CGO_ENABLED=0 $(GO) build ./...
	$(GO) vet ./...
	$(GO) test -count=1 ./...

test-race:
	$(GO) test -race -count=1 ./...

bench:
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) ./tensor/ ./loader/ ./nn/ ./paging/

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

synth:
	$(GO) run ./examples/synth -out /tmp/strata-synth -preset tinyllama-1.1b

include cuda/Makefile.inc
