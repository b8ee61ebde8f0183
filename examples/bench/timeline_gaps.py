#!/usr/bin/env python3
"""Where the link idles between the sparse blocks of a MoE decode.

Reads the timeline a CUDA backend writes at Close when STRATA_CUDA_TIMELINE
names a file (cuda/timeline.go: each copy up with when the host queued it
and when the copy engine ran it, each download with when the host asked and
had it), picks the decode steps (the last --tokens downloads of the logits,
--logits-bytes each) and the router's scores in them (4 bytes an expert),
and prints, over the sparse blocks whose misses were copied, the median,
mean and 90th percentile of (microseconds):

  q       from the host having the router's scores to its first copy queued
  busy    the copy engine's time on the block's copies
  chain   from the block's last copy landing to the next block's scores
          copied to the host (the device's work in between: the last
          miss's expert, the combine, the next attention and router)
  d2h     the device's time copying those scores down
  gap     from the block's last copy landing to the next block's first
          copy starting: the link idle, chain + the host's reaction + q

and, for each label the host marked (tensor.Mark: mark:LABEL records, e.g.
routed, split, reserved, acquired), the time from the host having the
scores to the block's first such mark: where q goes.

    STRATA_CUDA_TIMELINE=/tmp/tl.tsv bench -device cuda -model M -experts-cpu never ...
    python3 timeline_gaps.py /tmp/tl.tsv --experts 128 --logits-bytes 607744 --tokens 32
"""
import argparse
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--experts", type=int, required=True, help="experts a sparse block (the router's scores are 4 bytes each)")
    ap.add_argument("--logits-bytes", type=int, required=True, help="bytes of a decode step's logits download (4 x vocabulary)")
    ap.add_argument("--tokens", type=int, default=32, help="the decode steps to read, the last ones")
    a = ap.parse_args()
    recs = []
    with open(a.timeline) as f:
        next(f)
        for line in f:
            kind, n, host, host_end, start, end = line.rstrip("\n").split("\t")
            us = lambda x: None if x == "-" else int(x) / 1e3
            recs.append(dict(kind=kind, bytes=int(n), host=us(host), host_end=us(host_end), start=us(start), end=us(end)))
    d2h = [r for r in recs if r["kind"] == "d2h"]
    logits = [r for r in d2h if r["bytes"] == a.logits_bytes]
    if len(logits) < a.tokens + 1:
        raise SystemExit(f"{len(logits)} downloads of {a.logits_bytes} bytes: fewer than --tokens {a.tokens} and one")
    t0, t1 = logits[-a.tokens - 1]["host_end"], logits[-1]["host_end"]
    routers = [r for r in d2h if r["bytes"] == 4 * a.experts and t0 <= r["host"] <= t1]
    h2d = [r for r in recs if r["kind"] == "h2d" and r["start"] is not None]
    marks = sorted((r for r in recs if r["kind"].startswith("mark:")), key=lambda r: r["host"])
    labels = list(dict.fromkeys(r["kind"] for r in marks))
    rows = []
    for r, nxt in zip(routers, routers[1:]):
        cs = [c for c in h2d if r["host_end"] <= c["host"] < nxt["host"]]
        if not cs:
            continue
        row = dict(q=cs[0]["host"] - r["host_end"], busy=sum(c["end"] - c["start"] for c in cs),
                   chain=nxt["end"] - cs[-1]["end"], d2h=nxt["end"] - nxt["start"], copies=len(cs))
        for lab in labels:
            m = next((x for x in marks if x["kind"] == lab and r["host_end"] <= x["host"] < nxt["host"]), None)
            if m is not None:
                row[lab] = m["host"] - r["host_end"]
        later = [c for c in h2d if c["host"] >= nxt["host_end"]]
        if later:
            row["gap"] = later[0]["start"] - cs[-1]["end"]
        rows.append(row)
    if not rows:
        raise SystemExit("no sparse block with copies in the decode steps")
    print(f"{(t1 - t0) / a.tokens / 1e3:.2f} ms a token over {a.tokens} tokens; {len(rows)} sparse blocks with copies")
    for k in ["q", "busy", "chain", "d2h", "gap", "copies"] + labels:
        v = sorted(x[k] for x in rows if k in x)
        if not v:
            continue
        print(f"  {k:6s} median {statistics.median(v):8.1f}  mean {statistics.mean(v):8.1f}  p90 {v[int(0.9 * (len(v) - 1))]:8.1f}")


if __name__ == "__main__":
    main()
