#!/bin/sh
# GPU check of the CUDA backend, for a machine with a GPU but no Go: build
# bin/cuda.test first (make cuda-test-bin) and run this from the repository
# root. Logs go to $OUT (default /tmp/strata-gpu-check):
#   env.log        GPU, driver, cuBLAS found
#   ptxas.log      register/shared-memory use of the embedded PTX on this GPU
#   test.log       the test binary, verbose
#   memcheck.log   compute-sanitizer memcheck (leaks included) on the tests
#   racecheck.log  compute-sanitizer racecheck on the shared-memory kernels
#   memcheck-grad.log, racecheck-grad.log  the same on the backward kernels
#   memcheck-quant.log, racecheck-quant.log  the same on the quantized ones
#   bench.log      GEMV/GEMM paths, H2D pinned vs pageable
#   ncu.log        with GPU_CHECK_NCU=1: Nsight Compute kernel times and DRAM
#                  traffic of the GEMV variants and cuBLAS (clocks untouched)
# The last lines printed are a summary.
set -u
OUT=${OUT:-/tmp/strata-gpu-check}
mkdir -p "$OUT"
BIN=$(pwd)/bin/cuda.test
[ -x "$BIN" ] || { echo "gpu-check: $BIN missing; run make cuda-test-bin" >&2; exit 1; }

{
	nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
	nvcc --version 2>/dev/null | tail -2
	if ! ldconfig -p | grep -q 'libcublas\.so\.1[1-3]'; then
		dir=$(find /usr/local /opt /usr/lib -name 'libcublas.so.1[1-3]' 2>/dev/null | head -1 | xargs -r dirname)
		[ -n "$dir" ] && echo "cuBLAS not in the loader cache; using $dir"
	fi
} >"$OUT/env.log" 2>&1
dir=$(grep -o 'using .*' "$OUT/env.log" | cut -d' ' -f2)
[ -n "$dir" ] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cat "$OUT/env.log"

# Resource use on this GPU (sm_90), from the PTX as the driver JIT sees it.
if command -v ptxas >/dev/null 2>&1; then
	for f in cuda/kernels/*.ptx; do ptxas -arch=sm_90 -v -o /dev/null "$f" 2>&1; done |
		grep -E 'Compiling entry|registers|spill' | paste - - - >"$OUT/ptxas.log"
fi

cd cuda # the PTX freshness test reads kernels/ relative to the package
timeout 300 "$BIN" -test.v -test.count=1 -test.timeout 290s >"$OUT/test.log" 2>&1
echo "tests: exit $?"

if command -v compute-sanitizer >/dev/null 2>&1; then
	timeout 150 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 140s \
		-test.run 'TestBackend|TestMatMulPaths|TestAttentionCaches|TestArgmax|TestCast|TestCopyRowsOverlap|TestUploadAsyncOrdering|TestManagedMemory|TestCloseFreesEverything' \
		>"$OUT/memcheck.log" 2>&1
	echo "memcheck: exit $?"
	timeout 75 compute-sanitizer --tool racecheck --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 70s \
		-test.run 'TestBackend/(RMSNorm|Attention)|TestAttentionCaches|TestArgmax|TestCast' \
		>"$OUT/racecheck.log" 2>&1
	echo "racecheck: exit $?"
	# The backward kernels (tensor.GradOps), in runs of their own.
	timeout 150 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 140s \
		-test.run 'TestGradOps|TestMatMulGradPaths|TestAttentionGradShapes|TestCrossEntropyGradRows|TestGradErrors' \
		>"$OUT/memcheck-grad.log" 2>&1
	echo "memcheck (grad): exit $?"
	timeout 75 compute-sanitizer --tool racecheck --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 70s \
		-test.run 'TestAttentionGradShapes|TestGradOps/auto/(RMSNormGrad|BiasGrad|CrossEntropyGrad)' \
		>"$OUT/racecheck-grad.log" 2>&1
	echo "racecheck (grad): exit $?"
	# The quantized weights' kernels (the GEMVs through shared memory, the
	# dequantization that reads granules at the tensor's edges byte by byte).
	timeout 150 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 140s \
		-test.run 'TestQuantMatMul|TestQuantGEMVRows|TestQuantEmbed|TestQuantRefusals' \
		>"$OUT/memcheck-quant.log" 2>&1
	echo "memcheck (quant): exit $?"
	timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
		"$BIN" -test.short -test.count=1 -test.timeout 140s \
		-test.run 'TestQuant(MatMul|Embed)/.*/(gemv|tiled|blas)|TestQuantGEMVRows/Q4_K' \
		>"$OUT/racecheck-quant.log" 2>&1
	echo "racecheck (quant): exit $?"
fi

timeout 240 "$BIN" -test.run '^$' -test.bench . -test.benchtime 0.5s -test.count=1 -test.timeout 230s >"$OUT/bench.log" 2>&1
echo "bench: exit $?"

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${GPU_CHECK_NCU:-0}" = 1 ] && [ -n "$NCU" ]; then
	timeout 150 "$NCU" --clock-control none --print-summary per-kernel \
		--metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
		"$BIN" -test.run '^$' -test.bench 'BenchmarkGEMVVariants|BenchmarkQuantGEMV' -test.benchtime 3x >"$OUT/ncu.log" 2>&1
	echo "ncu: exit $?"
fi

echo "== summary"
grep -E '^(--- FAIL|FAIL|ok|PASS)|panic' "$OUT/test.log" | head -20
grep -cE '^\s*--- PASS' "$OUT/test.log" | sed 's/^/passed subtests: /'
grep -E -- '--- SKIP' "$OUT/test.log" | head -5
grep -E 'TestDevices|device 0:|cuBLAS|driver free' "$OUT/test.log" | head -5
[ -f "$OUT/memcheck.log" ] && grep -E 'ERROR SUMMARY|LEAK SUMMARY|^(ok|PASS|FAIL)' "$OUT/memcheck.log" | head -5
[ -f "$OUT/racecheck.log" ] && grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^(ok|PASS|FAIL)' "$OUT/racecheck.log" | head -5
[ -f "$OUT/memcheck-grad.log" ] && grep -E 'ERROR SUMMARY|LEAK SUMMARY|^(ok|PASS|FAIL)' "$OUT/memcheck-grad.log" | head -5
[ -f "$OUT/racecheck-grad.log" ] && grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^(ok|PASS|FAIL)' "$OUT/racecheck-grad.log" | head -5
[ -f "$OUT/memcheck-quant.log" ] && grep -E 'ERROR SUMMARY|LEAK SUMMARY|^(ok|PASS|FAIL)' "$OUT/memcheck-quant.log" | head -5
[ -f "$OUT/racecheck-quant.log" ] && grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^(ok|PASS|FAIL)' "$OUT/racecheck-quant.log" | head -5
grep -E '^Benchmark' "$OUT/bench.log"
[ -f "$OUT/ncu.log" ] && grep -E '^  [a-z_0-9]+.*\(|gpu__time_duration|dram__bytes_read|dram__throughput' "$OUT/ncu.log" | head -60
