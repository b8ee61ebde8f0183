#!/usr/bin/env python3
"""Hugging Face baseline for strata's examples/bench.

Runs the same model files with transformers (every weight on the GPU), with
transformers compiled (a static KV cache and torch.compile in
"reduce-overhead" mode, which captures CUDA graphs: the run "compiled", kind
"transformers-compiled"), and with accelerate (device_map="auto",
max_memory={0: budget}: offloaded weights are copied from CPU memory before
each use), and appends one JSON line per run in the schema of bench's
Result, so `bench -report` can join them. A run that fails (a torch or
transformers too old for the static cache, a compile error) appends its
line with the error instead.

    python3 hf_baseline.py --model DIR --name llama2-7b --runs resident,compiled,4GiB --out hf.jsonl
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def parse_size(s):
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = s.strip().lower()
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            return int(float(low[: -len(u)]) * units[u])
    return int(float(low) * (1 << 30))


def sync():
    torch.cuda.synchronize()


def measure(model, vocab, prefill, decode, warmup):
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, max(prefill + [16])), generator=g).to(dev)
    rates = {}
    with torch.inference_mode():
        model(prompt[:, :8], use_cache=False)  # warm-up
        for p in prefill:
            sync()
            t0 = time.perf_counter()
            model(prompt[:, :p], use_cache=False)
            sync()
            rates[str(p)] = p / (time.perf_counter() - t0)
        out = model(prompt[:, :16], use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)

        def step(nxt, past):
            out = model(nxt, past_key_values=past, use_cache=True)
            return out.logits[:, -1:].argmax(-1), out.past_key_values

        for _ in range(warmup):
            nxt, past = step(nxt, past)
        sync()
        t0 = time.perf_counter()
        for _ in range(decode):
            nxt, past = step(nxt, past)
        sync()
        el = time.perf_counter() - t0
    return rates, decode / el


def measure_compiled(model, vocab, prefill, decode, warmup):
    """Decode with a static cache and the forward compiled in
    "reduce-overhead" mode, through generate (which passes the cache
    positions the static cache needs on every transformers version that has
    one). The decode rate is the difference of two generate calls that
    differ only in new tokens, so the prompt's prefill cancels; prefill is
    timed by generate of one new token, after one untimed call of each
    length (the compiles)."""
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, max(prefill + [16])), generator=g).to(dev)
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def gen(ids, n):
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    rates = {}
    with torch.inference_mode():
        short, full = max(2, warmup), max(2, warmup) + decode
        for _ in range(2):  # compiles, then warms the captured graphs
            gen(prompt[:, :16], full)
        t_short = min(gen(prompt[:, :16], short) for _ in range(2))
        t_full = gen(prompt[:, :16], full)
        for p in prefill:
            gen(prompt[:, :p], 1)
            rates[str(p)] = p / gen(prompt[:, :p], 1)
    return rates, decode / max(t_full - t_short, 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--runs", default="resident,compiled",
                    help="comma-separated: resident, compiled (static cache and torch.compile), or a GPU budget (4GiB) for accelerate")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prefill = [int(x) for x in a.prefill.split(",") if x]
    for run in [r.strip() for r in a.runs.split(",") if r.strip()]:
        compiled = run == "compiled"
        budget = 0 if run in ("resident", "compiled") else parse_size(run)
        kind = "transformers-compiled" if compiled else "transformers" if budget == 0 else "accelerate"
        rec = {"kind": kind, "model": a.name, "device": "cuda:0", "run": run, "budget_bytes": budget,
               "strategy": "", "mode": "", "decode_tokens": a.decode, "prefill_tok_s": {}}
        try:
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            if budget == 0:
                model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float16, device_map="cuda:0")
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    a.model, dtype=torch.float16, device_map="auto",
                    max_memory={0: budget, "cpu": 200 * (1 << 30)})
            model.eval()
            rec["load_s"] = time.perf_counter() - t0
            weight = sum(p.numel() * p.element_size() for p in model.parameters())
            on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
            # accelerate's offloaded parameters sit on "meta" or "cpu" and
            # are copied in for every forward: weight - on_gpu per token.
            rec["weight_bytes"] = weight if budget == 0 else None
            torch.cuda.reset_peak_memory_stats()
            if compiled:
                rec["torch"] = torch.__version__
                rates, tok_s = measure_compiled(model, model.config.vocab_size, prefill, a.decode, a.warmup)
            else:
                rates, tok_s = measure(model, model.config.vocab_size, prefill, a.decode, a.warmup)
            rec["prefill_tok_s"] = rates
            rec["decode_tok_s"] = tok_s
            rec["peak_device_bytes"] = torch.cuda.max_memory_allocated()
            rec["streamed_bytes"] = max(0, weight - on_gpu) if budget else 0
            rec["bytes_per_token"] = float(rec["streamed_bytes"])
            if rec["weight_bytes"] is None:
                rec["weight_bytes"] = weight
            print(f"{a.name:12s} {kind:12s} {run:8s} decode {tok_s:8.2f} tok/s  prefill {rates}  "
                  f"on GPU {on_gpu/2**30:.2f} GiB of {weight/2**30:.2f} GiB  peak {rec['peak_device_bytes']/2**30:.2f} GiB", flush=True)
            del model
        except Exception as e:  # one failed run must not lose the others
            msg = str(e).strip().splitlines()
            rec["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
            print(f"{a.name} {run}: {rec['error']}", file=sys.stderr, flush=True)
        model = None  # also when the run failed after loading
        if compiled:
            try:
                torch._dynamo.reset()  # the compiled forward and its graphs
            except Exception:
                pass
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
