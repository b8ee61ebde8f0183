#!/usr/bin/env bash
# Runs the strata vs Hugging Face comparison on a GPU machine that has no Go
# and no network. Build the binaries first, on a machine with Go:
#   make bench-gpu        # writes bin/bench, bin/synth (cuda build)
# then, on the GPU machine, from the repository root:
#   OUT=bench-out examples/bench/run-gpu.sh
# STEPS picks what runs (default: all of synth-tiny synth-7b ceilings tiny 7b
# hf-tiny hf-7b report);
# MODELS is where the synthesised models go (16 GB).
set -uo pipefail
BIN=${BIN:-bin}
OUT=${OUT:-bench-out}
MODELS=${MODELS:-/tmp/strata-models}
STEPS=${STEPS:-"synth-tiny synth-7b ceilings tiny 7b hf-tiny hf-7b report"}
DECODE=${DECODE:-64}
mkdir -p "$OUT" "$MODELS"
has() { [[ " $STEPS " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
if has synth-tiny; then
	log synth tinyllama-1.1b
	"$BIN/synth" -out "$MODELS/tinyllama-1.1b" -preset tinyllama-1.1b -dtype f16 -seed 1 -shard-size 4GB
fi
if has synth-7b; then
	log synth llama2-7b
	"$BIN/synth" -out "$MODELS/llama2-7b" -preset llama2-7b -dtype f16 -seed 1 -shard-size 4GB
fi
if has ceilings; then
	log ceilings
	"$BIN/bench" -ceilings -device cuda -out "$OUT/strata.jsonl"
fi
if has tiny; then
	log strata tinyllama-1.1b
	"$BIN/bench" -device cuda -model "$MODELS/tinyllama-1.1b" -name tinyllama-1.1b -decode "$DECODE" -out "$OUT/strata.jsonl" \
		-runs ${RUNS_TINY:-none,1GiB:balanced,1GiB:minimal,1GiB:aggressive,1GiB:balanced:unified,1GiB:balanced:unified-noprefetch}
fi
if has 7b; then
	log strata llama2-7b
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode "$DECODE" -out "$OUT/strata.jsonl" \
		-runs ${RUNS_7B:-none,8GiB:balanced,4GiB:minimal,4GiB:balanced,4GiB:balanced:unified,4GiB:balanced:unified-noprefetch,2GiB:balanced}
	# aggressive reads every layer from disk for every token: fewer steps.
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode 6 -warmup 1 -prefill 128 -out "$OUT/strata.jsonl" \
		-runs ${RUNS_7B_SLOW:-4GiB:aggressive}
fi
export PYTHONUNBUFFERED=1
if has hf-tiny; then
	log hf tinyllama-1.1b
	python3 examples/bench/hf_baseline.py --model "$MODELS/tinyllama-1.1b" --name tinyllama-1.1b --runs resident,1GiB --decode "$DECODE" --out "$OUT/hf.jsonl"
fi
if has hf-7b; then
	log hf llama2-7b
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs resident --decode "$DECODE" --out "$OUT/hf.jsonl"
	# accelerate streams the offloaded weights synchronously (about 1 token/s at 4 GiB): fewer steps.
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs ${HF_7B_BUDGETS:-4GiB} --decode "${HF_DECODE:-12}" --warmup 2 --out "$OUT/hf.jsonl"
fi
if has report; then
	log report
	touch "$OUT/hf.jsonl"
	"$BIN/bench" -report "$OUT/strata.jsonl,$OUT/hf.jsonl" -md "$OUT/table.md" -json "$OUT/table.json"
fi
log done
