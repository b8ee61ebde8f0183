#!/usr/bin/env bash
# dropin.sh puts a model that run-gpu.sh (or recipe.sh) trained into the
# repository as the embedded default model, and updates what depends on it:
#   examples/internal/defaultmodel/strata-fortunes/  the model's files
#   examples/internal/defaultmodel/defaultmodel_test.go  wantIDs, the
#       greedy continuation of `make run`'s prompt
#   examples/train/loss.svg      the loss curve (examples/train/plot)
#   examples/train/train.log     the training run's output
#   README.md                    the sample and the numbers, between the
#       default-model markers
#
#   examples/train/dropin.sh DIR     (DIR: run-gpu.sh's OUT, holding
#                                     model.tar, loss.jsonl, train.log)
#
# It prints the share of the sample's words found in a word list
# (/usr/share/dict/words, Debian's wamerican, or WORDS=FILE) when there is
# one. Review the diff, then commit.
set -euo pipefail

IN=${1:?usage: dropin.sh DIR (holding model.tar, loss.jsonl and train.log)}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
DST=examples/internal/defaultmodel/strata-fortunes
TEST=examples/internal/defaultmodel/defaultmodel_test.go
PROMPT=$(sed -n 's/^\tprompt  = "\(.*\)"$/\1/p' "$TEST")
for f in model.tar loss.jsonl train.log; do
	[ -s "$IN/$f" ] || { echo "dropin.sh: $IN/$f is missing" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xf "$IN/model.tar" -C "$tmp"
[ -s "$tmp/model/config.json" ] || { echo "dropin.sh: $IN/model.tar holds no model/config.json" >&2; exit 1; }
rm -rf "$DST"
mkdir -p "$DST"
cp "$tmp"/model/* "$DST/"
cp "$IN/train.log" examples/train/train.log

device=$(head -n 1 "$IN/gpu.txt" 2> /dev/null | sed 's/ (UUID.*//' || true)
go run ./examples/train/plot -log "$IN/loss.jsonl" -out examples/train/loss.svg -vocab 3072 \
	-title "strata-fortunes: training loss${device:+ ($device)}"

# The greedy ids, recorded in the test (which fails until they are).
ids=$(go test ./examples/internal/defaultmodel -run TestGreedyStable -v 2>&1 | sed -n 's/.*greedy ids \[\(.*\)\]$/\1/p' | head -n 1 || true)
sed -i "s/^var wantIDs = .*/var wantIDs = []int{$(echo "$ids" | sed 's/ /, /g')}/" "$TEST"
go test ./examples/internal/defaultmodel

sample=$(go run ./examples/generate -prompt "$PROMPT" -max-new-tokens 24 -quiet 2> /dev/null)
held=$(grep 'held-out loss' "$IN/train.log" | tail -n 1 | sed 's/^step \([0-9]*\): held-out loss \([0-9.]*\), perplexity \([0-9.]*\) over \([0-9]*\) tokens (uniform: \([0-9]*\))/after step \1: held-out loss \2, perplexity \3 over \4 tokens (uniform: \5)/')
summary=$(grep '^train: [0-9]* steps' "$IN/train.log" | tail -n 1 | sed 's/^train: //')
params=$(grep -o '[0-9.]* M parameters' "$IN/train.log" | head -n 1)
WORDS=${WORDS:-/usr/share/dict/words}
if [ -s "$WORDS" ]; then
	printf '%s\n' "$sample" | tr -s ' \t\n' '\n' | tr -d '.,;:!?"()' | tr 'A-Z' 'a-z' | grep -v '^$' > "$tmp/words"
	known=$(grep -cxFf <(tr 'A-Z' 'a-z' < "$WORDS") "$tmp/words" || true)
	echo "dropin.sh: $known of $(wc -l < "$tmp/words") words of the sample are in $WORDS"
fi

{
	echo '```'
	echo "\$ make run    # prints the continuation of \"$PROMPT\""
	printf '%s\n' "$sample"
	echo '```'
	echo
	echo "${params:-The model}, trained${device:+ on $device}: $summary; $held."
	echo "The loss curve: [examples/train/loss.svg](examples/train/loss.svg); the run's output: examples/train/train.log."
} > "$tmp/block"
awk -v block="$tmp/block" '
	/<!-- default-model:begin -->/ { print; while ((getline l < block) > 0) print l; skip = 1; next }
	/<!-- default-model:end -->/ { skip = 0 }
	!skip' README.md > "$tmp/README.md"
cp "$tmp/README.md" README.md
echo "dropin.sh: updated $DST, $TEST (wantIDs $ids), examples/train/loss.svg, examples/train/train.log, README.md"
git status --short
