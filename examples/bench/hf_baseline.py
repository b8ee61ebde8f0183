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

With --batch N[,N...] each run (resident or a budget; not compiled) also
decodes N prompts of the same length together with generate() (greedy, the
default cache) and appends one more line per N whose "streams" field has
bench -streams' schema: aggregate decode tok/s, p50/p99 inter-token
latency and time to first token, so that the table sets them beside
strata's batched rows at the same budget.

    python3 hf_baseline.py --model DIR --name llama2-7b --runs resident,compiled,4GiB --out hf.jsonl
    python3 hf_baseline.py --model DIR --name llama2-7b --runs 4GiB --batch 1,8,32,64 --decode 8 --out hf.jsonl
"""
import argparse
import json
import math
import sys
import time

torch = None  # imported in main, so that --help works without torch


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


def percentile(xs, q):
    """The q-th percentile (0..100) of xs, nearest rank; 0 for none."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs), max(1, math.ceil(q / 100 * len(xs)))) - 1]


def measure_batch(model, vocab, n, prompt_len, decode, warmup):
    """Decodes n prompts of prompt_len tokens together with generate
    (greedy, every sequence generating decode tokens), after a shorter
    untimed call. The time of each step comes from a stopping criterion,
    which generate calls once a token is appended: the first is the time to
    first token (the batch's prefill), the gaps after it the inter-token
    latencies, shared by the n sequences of the step. The aggregate rate is
    n tokens a step over the steps after the first."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            sync()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (n, prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=max(2, warmup), min_new_tokens=max(2, warmup),
                       do_sample=False, pad_token_id=0)
        clock = Clock()
        sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                       pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
    ts = clock.times
    gaps = [(b - a) * 1e3 for a, b in zip(ts, ts[1:])]
    window = ts[-1] - ts[0] if len(ts) > 1 else 0
    ttft = (ts[0] - t0) * 1e3 if ts else 0
    return {
        "streams": n,
        "decode_tok_s": n * (len(ts) - 1) / window if window > 0 else 0,
        "inter_token_p50_ms": percentile(gaps, 50),
        "inter_token_p99_ms": percentile(gaps, 99),
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft,
        "mean_batch": float(n),
    }


def main():
    global torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--runs", default="resident,compiled",
                    help="comma-separated: resident, compiled (static cache and torch.compile), or a GPU budget (4GiB) for accelerate")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch", default="",
                    help="comma-separated batch sizes: also decode N prompts of --prompt-tokens together with generate in each run but compiled")
    ap.add_argument("--prompt-tokens", type=int, default=16,
                    help="the length of each prompt of a --batch run (bench -streams' prompts are 16 tokens)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prefill = [int(x) for x in a.prefill.split(",") if x]
    try:
        batches = [int(x) for x in a.batch.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--batch {a.batch!r}: want batch sizes such as 1,8,32")
    if any(n <= 0 for n in batches):
        ap.error(f"--batch {a.batch!r}: batch sizes must be positive")
    if a.prompt_tokens <= 0 or a.decode < 2:
        ap.error(f"--prompt-tokens {a.prompt_tokens} must be positive and --decode {a.decode} at least 2")
    import torch as _torch
    from transformers import AutoModelForCausalLM
    torch = _torch
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
            for n in [] if compiled else batches:
                # Its own line: decode_tok_s stays 0, so that it is no
                # single-stream baseline; the table reads "streams".
                brec = {k: rec[k] for k in ("kind", "model", "device", "run", "budget_bytes", "strategy", "mode", "weight_bytes", "streamed_bytes")}
                brec.update({"decode_tokens": a.decode, "prefill_tok_s": {}, "decode_tok_s": 0})
                try:
                    torch.cuda.reset_peak_memory_stats()
                    brec["streams"] = measure_batch(model, model.config.vocab_size, n, a.prompt_tokens, a.decode, a.warmup)
                    brec["peak_device_bytes"] = torch.cuda.max_memory_allocated()
                    st = brec["streams"]
                    print(f"{a.name:12s} {kind:12s} {run:8s} batch {n:3d}: {st['decode_tok_s']:8.2f} tok/s aggregate  "
                          f"inter-token p50 {st['inter_token_p50_ms']:.1f} ms p99 {st['inter_token_p99_ms']:.1f} ms  "
                          f"first token {st['ttft_p50_ms']:.0f} ms", flush=True)
                except Exception as e:  # an out-of-memory batch must not lose the others
                    msg = str(e).strip().splitlines()
                    brec["error"] = f"batch {n}: {type(e).__name__}: {msg[0] if msg else ''}"[:300]
                    print(f"{a.name} {run} batch {n}: {brec['error']}", file=sys.stderr, flush=True)
                with open(a.out, "a") as f:
                    f.write(json.dumps(brec) + "\n")
                torch.cuda.empty_cache()
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
