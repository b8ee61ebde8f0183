#!/usr/bin/env bash
# run-gpu.sh trains strata's default model on a GPU machine that has no Go:
# it runs the prebuilt cuda trainer bin/train on the inputs recipe.sh
# prepared (WORK/data, WORK/init) for DURATION of training, under a hard
# `timeout`, and writes into OUT (five files at most, as the device
# machines return):
#   model.tar   the trained model, directory model/ (config.json,
#               safetensors shards, tokenizer files), saved every 500 steps
#               and at the end into WORK/model
#   loss.jsonl  the loss log (examples/train/plot draws it)
#   train.log   the trainer's output: losses, tok/s, held-out perplexity,
#               samples
#   gpu.txt     the device
#   train-cpu.log  only when the CPU took over (below)
#
#   OUT=out examples/train/run-gpu.sh [WORK]    (default WORK=first-run)
#
# Environment: DURATION (default 140s), LIMIT (seconds the trainer may run
# in all, default 175), DEVICE (default cuda). Should the cuda run end
# without a model (no device, a driver error), the same training runs on
# the CPU for the time left, so that OUT always holds a model.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:-$ROOT/first-run}
: "${OUT:?set OUT to the output directory}"
DURATION=${DURATION:-140s}
LIMIT=${LIMIT:-175}
DEVICE=${DEVICE:-cuda}
source "$ROOT/examples/train/shape.sh"

for f in "$ROOT/bin/train" "$WORK/init/config.json" "$WORK/data/train.jsonl" "$WORK/data/heldout.jsonl"; do
	if [ ! -e "$f" ]; then
		echo "run-gpu.sh: $f is missing: build bin/train and run recipe.sh's preparation first (see its header)" >&2
		exit 1
	fi
done
mkdir -p "$OUT"
rm -rf "$WORK/model"
{ nvidia-smi -L || true; nproc; } > "$OUT/gpu.txt" 2>&1

train() { # device seconds duration
	timeout -k 5 "$2" "$ROOT/bin/train" -model "$WORK/init" -data "$WORK/data/train.jsonl" \
		-eval "$WORK/data/heldout.jsonl" -device "$1" -duration "$3" "${TRAIN[@]}" \
		-save "$WORK/model" -save-every 500 -log "$OUT/loss.jsonl" -quiet
}

start=$(date +%s)
train "$DEVICE" "$LIMIT" "$DURATION" > "$OUT/train.log" 2>&1
rc=$?
echo "run-gpu.sh: the $DEVICE training ended with status $rc after $(($(date +%s) - start)) s" | tee -a "$OUT/train.log"
if [ ! -s "$WORK/model/config.json" ] && [ "$DEVICE" != cpu ]; then
	left=$((LIMIT - ($(date +%s) - start)))
	if [ "$left" -gt 30 ]; then
		echo "run-gpu.sh: no model from $DEVICE; training on the CPU for $((left - 20)) s" | tee -a "$OUT/train.log"
		train cpu "$left" "$((left - 20))s" > "$OUT/train-cpu.log" 2>&1
		rc=$?
	fi
fi
tail -n 30 "$OUT/train.log"
# A run cut by the timeout still leaves its last checkpoint.
[ -s "$WORK/model/config.json" ] || { echo "run-gpu.sh: no model was saved (status $rc)" >&2; exit 1; }
tar -C "$WORK" -cf "$OUT/model.tar" model && ls -l "$OUT"
