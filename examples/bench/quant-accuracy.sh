#!/bin/bash
# quant-accuracy.sh measures what quantizing the weights costs in logits,
# on the CPU: each model converted to Q8_0, Q6_K and Q4_K GGUF
# (examples/convert), its F16 greedy continuations of some prompts
# teacher-forced through every version (generate -ids ... -logits-out), and
# the RMS logit error and top-1 agreement against F16 over the generated
# positions (examples/logitdiff -sums, added over the prompts).
#
#   examples/bench/quant-accuracy.sh [WORKDIR]
#
# Models: the embedded default (examples/internal/defaultmodel, trained)
# with 24 prompts of 40 new tokens, and the TinyLlama-1.1B shape
# synthesised with random weights (examples/synth, 2.2 GB in WORKDIR) with
# one prompt of 16 ids and 256 new tokens.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work/bin"
for c in generate convert synth logitdiff; do (cd "$root" && go build -o "$work/bin/$c" ./examples/$c); done
B=$work/bin
cd "$work"
# measure MODEL NAME PROMPT-ARGS... : one sequence's sums for each format.
measure() {
	local model=$1 name=$2; shift 2
	"$B/generate" -model "$model" -device cpu -quiet -json "$@" > gen.json
	local pl ids
	read -r pl ids < <(python3 -c "import json;d=json.load(open('gen.json'));print(len(d['prompt_ids']), ','.join(str(i) for i in d['prompt_ids']+d['ids']))")
	"$B/generate" -model "$model" -device cpu -quiet -ids "$ids" -max-new-tokens 0 -logits-out ref.safetensors > /dev/null
	for q in q8_0 q6_k q4_k; do
		"$B/generate" -model "$name-$q.gguf" -device cpu -quiet -ids "$ids" -max-new-tokens 0 -logits-out "$q.safetensors" > /dev/null
	done
	"$B/logitdiff" -sums -from $((pl - 1)) ref.safetensors q8_0.safetensors q6_k.safetensors q4_k.safetensors >> "$name.sums"
}
report() {
	awk -v name="$1" '{se[$1]+=$2; sr[$1]+=$3; a[$1]+=$4; n[$1]+=$5}
		END {for (f in se) printf "%s %s: RMS logit error %.2f%% of F16, top-1 agreement %d/%d (%.1f%%)\n", name, substr(f, 1, length(f)-12), 100*sqrt(se[f]/sr[f]), a[f], n[f], 100*a[f]/n[f]}' "$1.sums" | sort
}
convert_all() {
	for q in q8_0 q6_k q4_k; do "$B/convert" -model "$1" -out "$2-$q.gguf" -quantize $q -quiet -force; done
}

sf=$root/examples/internal/defaultmodel/strata-fortunes
convert_all "$sf" fortunes
: > fortunes.sums
while read -r p; do measure "$sf" fortunes -prompt "$p" -max-new-tokens 40; done <<'PROMPTS'
The secret of life is
A friend in need
You will find
The best way to
Never trust a
Today is a good day to
If at first you
Money can't buy
The early bird
A journey of a thousand miles
Love is
Time flies when
Do not count
An apple a day
All that glitters
When in doubt
Fortune favors
Laughter is
Every cloud has
Knowledge is
The only thing
Patience is
Happiness is
You cannot
PROMPTS
report fortunes

[ -d tl ] || "$B/synth" -out tl -preset tinyllama-1.1b -dtype f16 -seed 1 > /dev/null
convert_all tl tinyllama
: > tinyllama.sums
measure tl tinyllama -ids 1,450,1000,2000,3000,4000,5000,6000,7000,8000,9000,10000,11000,12000,13000,14000 -max-new-tokens 256
report tinyllama
