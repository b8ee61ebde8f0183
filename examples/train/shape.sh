# shape.sh is sourced by recipe.sh and run-gpu.sh: the default model's
# shape and training hyperparameters, in one place.
#
# The model: Llama with 6 blocks of hidden 256 (8 heads of 32, 4 KV
# heads), an MLP of 768, a 3,072-token vocabulary whose embedding is tied
# to the LM head, and 512 positions: 5.5 M parameters, 11 MB in F16, saved
# in safetensors shards of under 2 MB (make lint refuses larger files).
VOCAB=3072
SHAPE=(-hidden 256 -layers 6 -heads 8 -kv-heads 4 -intermediate 768 -max-pos 512 -vocab $VOCAB -tie -seed 1)
# Training: windows of 256 tokens, 16 a step (4,096 tokens), AdamW with a
# linear warm-up and a cosine that follows -duration, recompute
# checkpoints over 2 segments, the dynamic loss scale of F16 weights.
TRAIN=(-seq-len 256 -batch 16 -lr 2e-3 -min-lr 1e-4 -warmup 60 -weight-decay 0.1 -checkpoint-segments 2
	-steps 1000000 -eval-every 500 -eval-tokens 0 -log-every 25 -shard-bytes 1900000 -prompt "The secret of life is")
