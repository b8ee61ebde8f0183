# CPU backend benchmarks; the top-level Makefile includes this file.
#
#   bench-cpu   the CPU kernels (GFLOP/s, GB/s), then decode and prefill of the
#               TinyLlama-1.1B shape (random weights from the synthesiser) in F16
#               and F32 on 1 and 2 threads: tok/s, weight GB/s, allocs per step
#
# The synthesised models (2.2 GB in F16, 4.4 GB in F32) are written once into
# BENCH_CPU_DIR and removed at the end unless BENCH_CPU_KEEP=1. The machine
# may be shared: BENCH_CPU_COUNT repeats each benchmark, report the best or
# the median. STRATA_CPU_KERNELS=go (or avx2) measures the other kernels.

BENCH_CPU_DIR     ?= $(or $(TMPDIR),/tmp)/strata-bench-cpu
BENCH_CPU_COUNT   ?= 3
BENCH_CPU_DECODE  ?= 16x
BENCH_CPU_PREFILL ?= 2x
BENCH_CPU_KEEP    ?=

.PHONY: bench-cpu

bench-cpu:
	$(GO) test -run '^$$' -bench 'Kernels|MatMul|Attention|Gorgonia' -count 1 ./tensor/
	@status=0; \
	STRATA_BENCH_LARGE=1 STRATA_BENCH_DIR=$(BENCH_CPU_DIR) $(GO) test -run '^$$' -timeout 60m \
		-bench '^BenchmarkDecode$$' -benchtime $(BENCH_CPU_DECODE) -count $(BENCH_CPU_COUNT) ./nn/ || status=$$?; \
	STRATA_BENCH_LARGE=1 STRATA_BENCH_DIR=$(BENCH_CPU_DIR) $(GO) test -run '^$$' -timeout 60m \
		-bench '^BenchmarkPrefill$$' -benchtime $(BENCH_CPU_PREFILL) -count $(BENCH_CPU_COUNT) ./nn/ || status=$$?; \
	if [ -z "$(BENCH_CPU_KEEP)" ]; then rm -rf $(BENCH_CPU_DIR); fi; \
	exit $$status
