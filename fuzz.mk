# Fuzzing: included from the Makefile.
#
#   make fuzz                  every fuzz target for FUZZTIME (default 30s)
#   make fuzz FUZZTIME=5m      longer
#   make fuzz-ci               every fuzz target for 500 inputs: what CI runs
#
# Targets are found, not listed: every func FuzzX in a _test.go file of the
# module (build-tagged ones, such as the CUDA fuzzer, are skipped when the
# tag is not set). A failing input is written to the package's
# testdata/fuzz/FuzzX/ and then replayed by plain go test.
FUZZTIME ?= 30s
# Minimising a new input costs up to this much on top of FUZZTIME.
FUZZMINIMIZETIME ?= 5s
# Fuzzing workers per target; empty means GOMAXPROCS.
FUZZPARALLEL ?=

FUZZPKGS = $(shell grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u)

.PHONY: fuzz fuzz-ci

# run-fuzz runs every target for $(1), minimising new inputs for up to $(2).
define run-fuzz
@set -e; for pkg in $(FUZZPKGS); do \
  for target in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
    echo "== $$pkg $$target for $(1)"; \
    $(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(1) \
      -fuzzminimizetime $(2) $(if $(FUZZPARALLEL),-parallel $(FUZZPARALLEL)) $$pkg; \
  done; \
done
endef

fuzz:
	$(call run-fuzz,$(FUZZTIME),$(FUZZMINIMIZETIME))

# CI counts inputs rather than seconds: with a duration, Go 1.26's fuzzing
# coordinator can report its own deadline as a failure ("context deadline
# exceeded", no input written; go.dev/issue/75804, fixed in Go 1.27), which
# a loaded machine makes likely. 500 inputs take 1 to 4 s a target here.
fuzz-ci:
	$(call run-fuzz,500x,100x)
