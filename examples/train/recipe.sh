#!/usr/bin/env bash
# recipe.sh builds strata's small default model (examples/internal/
# defaultmodel) from scratch with strata's own tools: the corpus (Debian's
# fortunes and the Jargon File, see CORPUS.md), a byte-level BPE tokenizer
# trained on it, a random initialisation, and the training, with recompute
# checkpoints and the dynamic loss scale on F16 weights (shape.sh holds
# the shape and hyperparameters).
#
#   examples/train/recipe.sh [WORK]        (default WORK=first-run, ignored by git)
#
# Environment:
#   STAGE  prepare: the corpus, the tokenizer and the initial model only
#                   (what run-gpu.sh needs on a GPU machine without Go);
#          train:   all of it, then the training on DEVICE for DURATION
#                   (the default).
#   DEVICE -device of the training (default auto: cuda when built with the
#          cuda tag and a GPU is there, else the CPU).
#   DURATION  training time (default 140s; on two CPU cores the model
#          learns little in that: see run-gpu.sh for the GPU run).
#
# Each preparation stage is skipped when its output exists. The result is
# WORK/model, the loss log WORK/loss.jsonl and the run's output
# WORK/train.log; examples/train/plot draws the loss curve.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:-$ROOT/first-run}
STAGE=${STAGE:-train}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
source "$ROOT/examples/train/shape.sh"

BIN=$WORK/bin
tags=()
if [ "${DEVICE:-auto}" != cpu ] && command -v nvcc > /dev/null; then tags=(-tags cuda); fi
(cd "$ROOT" && go build -o "$BIN/" ./examples/train/prepare ./examples/trainbpe ./examples/synth &&
	go build "${tags[@]}" -o "$BIN/" ./examples/train)

# 1. The corpus: the packages' files, unpacked (not installed), then the
# documents, split 95/5 by a hash of each.
if [ ! -s "$WORK/data/train.jsonl" ]; then
	mkdir -p "$WORK/debs"
	(cd "$WORK/debs" && { apt-get download fortunes fortunes-min jargon-text ||
		{ apt-get update -qq && apt-get download fortunes fortunes-min jargon-text; }; } &&
		for d in *.deb; do dpkg-deb -x "$d" root; done)
	"$BIN/prepare" -fortunes "$WORK/debs/root/usr/share/games/fortunes" \
		-jargon "$WORK/debs/root/usr/share/doc/jargon-text/jargon.txt.gz" -out "$WORK/data" -heldout 0.05
fi

# 2. The tokenizer, trained on the training split only.
if [ ! -s "$WORK/tokenizer/tokenizer.json" ]; then
	"$BIN/trainbpe" -data "$WORK/data/train.jsonl" -vocab $VOCAB -out "$WORK/tokenizer"
fi

# 3. The random initialisation (examples/synth: projections of standard
# deviation 1/sqrt(fan-in), the residual outputs smaller by
# 1/sqrt(2 layers), the embedding 1/sqrt(hidden)).
if [ ! -s "$WORK/init/config.json" ]; then
	"$BIN/synth" -out "$WORK/init" -preset tiny "${SHAPE[@]}" -tokenizer-from "$WORK/tokenizer"
fi
[ "$STAGE" = prepare ] && exit 0

# 4. Training.
"$BIN/train" -model "$WORK/init" -data "$WORK/data/train.jsonl" -eval "$WORK/data/heldout.jsonl" \
	-device "${DEVICE:-auto}" -duration "${DURATION:-140s}" "${TRAIN[@]}" \
	-save "$WORK/model" -save-every 500 -log "$WORK/loss.jsonl" 2>&1 | tee "$WORK/train.log"
