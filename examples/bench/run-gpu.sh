#!/usr/bin/env bash
# Runs the strata vs Hugging Face comparison on a GPU machine that has no Go
# and no network. Build the binaries first, on a machine with Go:
#   make bench-gpu        # writes bin/bench, bin/synth (cuda build)
# then, on the GPU machine, from the repository root:
#   OUT=bench-out examples/bench/run-gpu.sh
# STEPS picks what runs (default: all of synth-tiny synth-7b ceilings tiny 7b
# hf-tiny hf-7b report; 7b-streams, the batched decode of -streams, is a
# step of its own, and 7b-streams-host the same with the KV cache in host
# memory); the mixtures of experts are steps of their own,
# not in the default: synth-mixtral mixtral hf-mixtral (Mixtral-8x7B shape,
# 93 GB in F16) and synth-qwen3moe qwen3moe hf-qwen3moe (Qwen3-30B-A3B
# shape, 61 GB), each synthesised once with uniform routing and given a
# second config with skewed, temporally local routing (the same weights,
# hard-linked); reports say "synthetic routing"; synth-mixtral-q8
# mixtral-q8 (the Mixtral-8x7B shape as a Q8_0 GGUF file, 49 GB, its
# experts in Q8_0: one file, run with bench's -router-skew 0 and 1.2
# -router-locality 0.5; no Hugging Face baseline, which would dequantize
# it to 93 GB); and synth-7b-long 7b-long
# (long prompts under a budget with the KV cache in host memory: the 7B
# shape given a context of 32,768 positions, an 8,000-token prompt at
# 4 GiB and a 32,000-token one at 8 GiB, -kv-cache host and auto; needs
# synth-7b); and, for the issues' measurements, 7b-hybrid (issue 14's
# rows in one process: 4 GiB balanced, cpu and hybrid, then hybrid at 2
# and 8 GiB; HYBRID_THREADS, default 16, is -threads), fold (the decode
# with a block's norms folded into its products against unfolded,
# STRATA_CUDA_FOLD alternated: the 7B with 0 and all, TinyLlama with 0 and
# 1) and cpu-bw (the CPU device's decode against the host's read
# bandwidth at 8, 12 and 16 threads, TinyLlama and the 7B); each needs its
# models' synth steps.
# EXPERTS_CPU (auto, never, always) is the MoE runs' -experts-cpu: when a
# missing expert is computed on the CPU instead of uploaded (default auto).
# MODELS is where the synthesised models go (16 GB, and the MoE ones'
# sizes: a disk of 64 GB holds one of them at most).
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
# routing DIR OUT SKEW LOCALITY: a copy of DIR's model (weights hard-linked)
# whose config.json asks for synthetic routing of that skew and locality.
routing() {
	mkdir -p "$2" && ln -f "$1"/*.safetensors "$1"/*.json "$2"/ && rm -f "$2/config.json" &&
		python3 -c 'import json, sys
c = json.load(open(sys.argv[1]))
c["strata_synthetic_routing"] = {"skew": float(sys.argv[3]), "locality": float(sys.argv[4]), "seed": 1}
json.dump(c, open(sys.argv[2], "w"), indent=2)' "$1/config.json" "$2/config.json" "$3" "$4"
}
# context DIR OUT N: a copy of DIR's model (weights hard-linked) whose
# config.json says max_position_embeddings N.
context() {
	mkdir -p "$2" && ln -f "$1"/*.safetensors "$1"/*.json "$2"/ && rm -f "$2/config.json" &&
		python3 -c 'import json, sys
c = json.load(open(sys.argv[1]))
c["max_position_embeddings"] = int(sys.argv[3])
json.dump(c, open(sys.argv[2], "w"), indent=2)' "$1/config.json" "$2/config.json" "$3"
}
if has synth-7b-long; then
	log synth llama2-7b-32k
	context "$MODELS/llama2-7b" "$MODELS/llama2-7b-32k" 32768
fi
if has synth-mixtral; then
	log synth mixtral-8x7b
	"$BIN/synth" -out "$MODELS/mixtral-8x7b" -preset mixtral-8x7b -dtype f16 -seed 1 -shard-size 4GB -router-skew 0 &&
		routing "$MODELS/mixtral-8x7b" "$MODELS/mixtral-8x7b-skewed" 1.2 0.5
fi
if has synth-mixtral-q8; then
	log synth mixtral-8x7b q8_0
	"$BIN/synth" -out "$MODELS/mixtral-8x7b-q8_0.gguf" -preset mixtral-8x7b -dtype q8_0 -seed 1 -router-skew 0
fi
if has synth-qwen3moe; then
	log synth qwen3-30b-a3b
	"$BIN/synth" -out "$MODELS/qwen3-30b-a3b" -preset qwen3-30b-a3b -dtype f16 -seed 1 -shard-size 4GB -router-skew 0 &&
		routing "$MODELS/qwen3-30b-a3b" "$MODELS/qwen3-30b-a3b-skewed" 1.2 0.5
fi
if has ceilings; then
	log ceilings
	"$BIN/bench" -ceilings -device cuda -out "$OUT/strata.jsonl"
fi
if has tiny; then
	log strata tinyllama-1.1b
	"$BIN/bench" -device cuda -model "$MODELS/tinyllama-1.1b" -name tinyllama-1.1b -decode "$DECODE" -out "$OUT/strata.jsonl" \
		-runs ${RUNS_TINY:-none,1GiB:balanced,1GiB:minimal,1GiB:aggressive,1GiB:balanced:unified,1GiB:balanced:unified-noprefetch}
	# The same resident run launch by launch: launches per token before
	# and after decode graphs.
	"$BIN/bench" -device cuda -model "$MODELS/tinyllama-1.1b" -name tinyllama-1.1b -decode "$DECODE" -out "$OUT/strata.jsonl" -graphs=false -runs none
fi
if has 7b; then
	log strata llama2-7b
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode "$DECODE" -out "$OUT/strata.jsonl" \
		-runs ${RUNS_7B:-none,8GiB:balanced,4GiB:minimal,4GiB:balanced,4GiB:balanced:unified,4GiB:balanced:unified-noprefetch,2GiB:balanced}
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode "$DECODE" -out "$OUT/strata.jsonl" -graphs=false -runs none,4GiB:balanced
	# aggressive reads every layer from disk for every token: fewer steps.
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode 6 -warmup 1 -prefill 128 -out "$OUT/strata.jsonl" \
		-runs ${RUNS_7B_SLOW:-4GiB:aggressive}
fi
# Batched decode: 1, 8, 32 and 64 requests at once through the batcher,
# the 7B shape resident and at 4 GiB, each run sweeping the counts over the
# one engine it opened (its plan keeps room for the largest pool):
# aggregate tok/s, inter-token latency and time to first token per count
# in the "streams_sweep" field of each result; then Hugging Face generate
# with the same batch sizes and 16-token prompts, resident and under
# accelerate at 4 GiB (which streams slowly: a few steps), in the same run.
# The report's batched table sets each count beside Hugging Face's batch
# of that size.
STREAMS=${STREAMS:-"1 8 32 64"}
if has 7b-streams; then
	counts=$(echo $STREAMS | tr ' ' ',')
	log strata llama2-7b streams=$counts
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b -decode "$DECODE" -prefill 128 -streams "$counts" \
		-out "$OUT/strata.jsonl" -runs ${RUNS_7B_STREAMS:-none,4GiB:balanced}
	export PYTHONUNBUFFERED=1
	batches=$counts
	log hf llama2-7b batch=$batches
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs resident --prefill 128 \
		--decode "$DECODE" --batch "$batches" --prompt-tokens 16 --out "$OUT/hf.jsonl"
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs ${HF_7B_BUDGETS:-4GiB} --prefill 128 \
		--decode "${HF_STREAMS_DECODE:-4}" --warmup 2 --batch "$batches" --prompt-tokens 16 --out "$OUT/hf.jsonl"
fi
# Batched decode with the KV cache in host memory (-kv-cache host): every
# block's part of the batcher's pool stays in host memory and the CPU
# attends over it at every step; 8 and 32 streams at 4 GiB, named
# llama2-7b-kvhost in the table.
if has 7b-streams-host; then
	log strata llama2-7b streams=${STREAMS_HOST:-8,32} kv-cache host
	"$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b-kvhost -decode "${DECODE_STREAMS_HOST:-16}" -warmup 2 -prefill 128 \
		-kv-cache host -streams "${STREAMS_HOST:-8,32}" -out "$OUT/strata.jsonl" -runs ${RUNS_7B_STREAMS_HOST:-4GiB:balanced}
fi
# Long prompts: the KV cache of an 8,000-token prompt (7.9 GiB in F32) does
# not fit a 4 GiB budget on the device, nor a 32,000-token one's (31 GiB)
# 8 GiB: in host memory the CPU attends over it in decode and prefill
# uploads it. Each result reports prefill at the prompt's length, decode
# at that context, the CPU's attention time and the bound with the host KV
# reads counted; the resident run with the cache on the device is the
# reference.
if has 7b-long; then
	log strata llama2-7b-32k
	M="$MODELS/llama2-7b-32k"
	"$BIN/bench" -device cuda -model "$M" -name llama2-7b-8k -prefill 512 -prompt-tokens 8000 -decode 16 -warmup 2 -out "$OUT/strata.jsonl" \
		-runs none
	for kv in host auto; do
		"$BIN/bench" -device cuda -model "$M" -name "llama2-7b-8k-kv-$kv" -kv-cache $kv -prefill 512 -prompt-tokens 8000 -decode 16 -warmup 2 -out "$OUT/strata.jsonl" \
			-runs ${RUNS_7B_8K:-4GiB:balanced,4GiB:hybrid}
		"$BIN/bench" -device cuda -model "$M" -name "llama2-7b-32k-kv-$kv" -kv-cache $kv -prefill 512 -prompt-tokens 32000 -decode 8 -warmup 1 -out "$OUT/strata.jsonl" \
			-runs ${RUNS_7B_32K:-8GiB:balanced,8GiB:hybrid}
	done
fi
# The mixtures of experts: experts paged one by one, each policy, uniform
# routing (the worst case) and skewed. Prefill of 128 tokens uses most
# experts of every block; the decode steps are what the bound judges.
if has mixtral; then
	for m in mixtral-8x7b mixtral-8x7b-skewed; do
		log strata $m
		"$BIN/bench" -device cuda -model "$MODELS/$m" -name $m -decode "$DECODE" -prefill 128 ${EXPERTS_CPU:+-experts-cpu $EXPERTS_CPU} -out "$OUT/strata.jsonl" \
			-runs ${RUNS_MIXTRAL:-24GiB:balanced:explicit:lru,24GiB:balanced:explicit:lfu}
	done
fi
if has mixtral-q8; then
	for routing in "0 0" "1.2 0.5"; do
		set -- $routing
		log strata mixtral-8x7b-q8_0 skew $1 locality $2
		"$BIN/bench" -device cuda -model "$MODELS/mixtral-8x7b-q8_0.gguf" -name mixtral-8x7b-q8_0-skew$1 -decode "$DECODE" -prefill 128 ${EXPERTS_CPU:+-experts-cpu $EXPERTS_CPU} \
			-router-skew $1 -router-locality $2 -out "$OUT/strata.jsonl" -runs ${RUNS_MIXTRAL_Q8:-16GiB:balanced:explicit:lru,16GiB:balanced:explicit:lfu}
	done
fi
if has qwen3moe; then
	for m in qwen3-30b-a3b qwen3-30b-a3b-skewed; do
		log strata $m
		"$BIN/bench" -device cuda -model "$MODELS/$m" -name $m -decode "$DECODE" -prefill 128 ${EXPERTS_CPU:+-experts-cpu $EXPERTS_CPU} -out "$OUT/strata.jsonl" \
			-runs ${RUNS_QWEN3MOE:-8GiB:balanced:explicit:lru,8GiB:balanced:explicit:lfu}
	done
fi
export PYTHONUNBUFFERED=1
if has hf-tiny; then
	log hf tinyllama-1.1b
	python3 examples/bench/hf_baseline.py --model "$MODELS/tinyllama-1.1b" --name tinyllama-1.1b --runs resident,compiled,1GiB --decode "$DECODE" --out "$OUT/hf.jsonl"
fi
if has hf-7b; then
	log hf llama2-7b
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs resident,compiled --decode "$DECODE" --out "$OUT/hf.jsonl"
	# accelerate streams the offloaded weights synchronously (about 1 token/s at 4 GiB): fewer steps.
	python3 examples/bench/hf_baseline.py --model "$MODELS/llama2-7b" --name llama2-7b --runs ${HF_7B_BUDGETS:-4GiB} --decode "${HF_DECODE:-12}" --warmup 2 --out "$OUT/hf.jsonl"
fi
if has hf-mixtral; then
	log hf mixtral-8x7b
	# accelerate offloads whole modules: a few tokens are enough.
	python3 examples/bench/hf_baseline.py --model "$MODELS/mixtral-8x7b" --name mixtral-8x7b --runs 24GiB --prefill 128 --decode 3 --warmup 1 --out "$OUT/hf.jsonl"
fi
if has hf-qwen3moe; then
	log hf qwen3-30b-a3b
	python3 examples/bench/hf_baseline.py --model "$MODELS/qwen3-30b-a3b" --name qwen3-30b-a3b --runs 8GiB --prefill 128 --decode 3 --warmup 1 --out "$OUT/hf.jsonl"
fi
if has 7b-hybrid; then
	log strata llama2-7b hybrid
	T=${HYBRID_THREADS:-16}
	"$BIN/bench" -device cuda -threads $T -model "$MODELS/llama2-7b" -name llama2-7b -prefill 512 -decode 16 -warmup 2 -out "$OUT/strata.jsonl" \
		-runs 4GiB:balanced,4GiB:cpu,4GiB:hybrid
	"$BIN/bench" -device cuda -threads $T -model "$MODELS/llama2-7b" -name llama2-7b -prefill 512 -decode 16 -warmup 2 -out "$OUT/strata.jsonl" \
		-runs 2GiB:hybrid,8GiB:hybrid
fi
if has fold; then
	for round in 1 2; do
		for f in 0 all; do
			log strata llama2-7b STRATA_CUDA_FOLD=$f
			STRATA_CUDA_FOLD=$f "$BIN/bench" -device cuda -model "$MODELS/llama2-7b" -name llama2-7b-fold-$f -decode 128 -warmup 2 -prefill 512 \
				-out "$OUT/strata.jsonl" -runs none
		done
		for f in 0 1; do
			log strata tinyllama-1.1b STRATA_CUDA_FOLD=$f
			STRATA_CUDA_FOLD=$f "$BIN/bench" -device cuda -model "$MODELS/tinyllama-1.1b" -name tinyllama-1.1b-fold-$f -decode 256 -warmup 2 \
				-prefill 512 -out "$OUT/strata.jsonl" -runs none
		done
	done
fi
if has cpu-bw; then
	for t in 16 12 8; do
		log strata tinyllama-1.1b cpu threads=$t
		"$BIN/bench" -device cpu -threads $t -model "$MODELS/tinyllama-1.1b" -name tinyllama-1.1b-cpu$t -decode 48 -warmup 4 -prefill 16 \
			-out "$OUT/strata.jsonl" -runs none
	done
	log strata llama2-7b cpu threads=16
	"$BIN/bench" -device cpu -threads 16 -model "$MODELS/llama2-7b" -name llama2-7b-cpu16 -decode 12 -warmup 2 -prefill 16 \
		-out "$OUT/strata.jsonl" -runs none
fi
if has report; then
	log report
	touch "$OUT/hf.jsonl"
	"$BIN/bench" -report "$OUT/strata.jsonl,$OUT/hf.jsonl" -md "$OUT/table.md" -json "$OUT/table.json"
fi
log done
