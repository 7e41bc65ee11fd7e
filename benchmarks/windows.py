"""Long sentences embedded as overlapping windows (model/windows.py): how far the stitched vectors are
from the whole-sequence vectors, and what one very long sentence costs through the pipeline.

    .venv/bin/python -m benchmarks.windows [--tokens 3000] [--window 1000] [--overlaps 0 100 200 300] \
        [--pipeline-tokens 100000] [--threads 1] [--speed N [--config original] [--max-tokens 4096 16384]
        [--repeats 3]] [--tag NAME]

Shipped default model, stateless. A WikiText-2 valid sequence of --tokens tokens is embedded whole and
windowed; the table gives the top layer's mean |diff| by distance from a window cut (overlap 0, where the
cuts are window edges) and, per overlap, the mean |diff| over all positions relative to the mean |vector|.
With --pipeline-tokens N, one sentence of N tokens runs through `pipeline.run` in a child process, which
reports wall time, windowed sentences and peak RSS. With --speed N, N consecutive WikiText-2 valid sequences of
--tokens tokens (window --window, overlap 200 at most window / 5) are embedded one window per call (budget
window + 2, as the `elmo` command did before session 12), one sentence at a time (model.windows.embed_long, as the
pipeline did) and all at once (embed_long_many: the windows of all of them share the sub-batches), side by side
per budget, medians of --repeats; --config names a published shape with random weights instead of the shipped
model. Writes benchmarks/results/windows[_TAG].json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import RESULTS, SHARED, machine

CHILD = """
import json, resource, sys
from pipeline.run import counters, run
c = counters(run(sys.argv[1:]))
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "windowed_sentences": c.get("windowed_sentences", 0), "tokens": c.get("tokens", 0)}))
"""


def wikitext_tokens(n: int) -> list[str]:
    out: list[str] = []
    with open(os.path.join(SHARED, "data", "wikitext-2", "valid.txt"), encoding="utf-8") as f:
        for line in f:
            out += line.split()
            if len(out) >= n:
                return out[:n]
    return out


def stitch_error(embedder, tokens: list[str], window: int, overlaps: list[int]) -> dict:
    from model.windows import embed_long, stitch_plan, window_spans
    whole = embedder.embed_sentence(tokens)[-1]
    scale = float(np.abs(whole).mean())
    rows = {}
    for v in overlaps:
        diff = np.abs(embed_long(embedder, tokens, window, v, 4096)[-1] - whole).mean(axis=-1)   # (T,)
        rows[v] = {"mean_abs_diff": float(diff.mean()), "relative": float(diff.mean()) / scale}
        if v == 0:
            cuts = [start for start, _ in stitch_plan(window_spans(len(tokens), window, 0))[1:]]
            dist = np.min(np.abs(np.arange(len(tokens))[:, None] - np.array(cuts)[None, :]), axis=1)
            rows[v]["by_distance"] = {d: float(diff[dist == d].mean()) for d in (0, 10, 50, 100, 200)
                                      if (dist == d).any()}
    return {"mean_abs_vector": scale, "overlaps": rows}


def long_sentence_run(n: int, threads: int) -> dict:
    tokens = wikitext_tokens(n)
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "long.txt")
        with open(inp, "w", encoding="utf-8") as f:
            f.write(" ".join(tokens) + "\n")
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD, "--input", inp, "--output", os.path.join(tmp, "out"),
                            "--input-format", "lines", "--tokenizer", "whitespace", "--torch-threads", str(threads),
                            "--progress", "off"], capture_output=True, text=True, check=True)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tokens": len(tokens), "wall_s": time.perf_counter() - t, **out}


def windows_speed(embedder, n: int, tokens: int, window: int, budgets: list[int], repeats: int) -> list[dict]:
    """tokens/s of N sentences of `tokens` tokens in windows: one window per call, one sentence at a time and all at
    once."""
    import statistics

    from model.windows import default_overlap, embed_long, embed_long_many
    seq = wikitext_tokens(n * tokens)
    sentences = [seq[i * tokens: (i + 1) * tokens] for i in range(n)]
    overlap = default_overlap(window)
    n_tokens = sum(len(s) for s in sentences)
    ways = {"one at a time": lambda b: [embed_long(embedder, s, window, overlap, b) for s in sentences],
            "together": lambda b: embed_long_many(embedder, sentences, window, overlap, b)}

    def seconds(call) -> float:
        t = time.perf_counter()
        call()
        return time.perf_counter() - t
    per_call: list[float] = []          # one window per call (budget window + 2): the same at every budget
    rows = []
    for budget in budgets:
        ways["together"](budget)                       # warm-up: token cache, workspaces
        times = {name: [] for name in ways}
        for _ in range(repeats):                       # the ways interleaved
            if len(per_call) < repeats:
                per_call.append(seconds(lambda: [embed_long(embedder, s, window, overlap, window + 2)
                                                 for s in sentences]))
            for name, call in ways.items():
                times[name].append(seconds(lambda: call(budget)))
        row = {"budget": budget, "sentences": n, "tokens": n_tokens, "window": window, "overlap": overlap,
               "one window per call tokens_per_s": n_tokens / statistics.median(per_call),
               **{f"{name} tokens_per_s": n_tokens / statistics.median(ts) for name, ts in times.items()}}
        row["speed-up"] = row["together tokens_per_s"] / row["one at a time tokens_per_s"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--overlaps", type=int, nargs="+", default=[0, 100, 200, 300])
    ap.add_argument("--pipeline-tokens", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speed", type=int, default=0, metavar="N",
                    help="also time N sentences of --tokens tokens in windows: one at a time against together")
    ap.add_argument("--config", default=None, help="--speed: a published shape with random weights (default: shipped)")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[4096], help="--speed: budgets (token slots)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import torch

    from model.embedder import ElmoEmbedder
    torch.set_num_threads(args.threads)
    result = {"machine": machine(), "window": args.window,
              "stitch": stitch_error(ElmoEmbedder(), wikitext_tokens(args.tokens), args.window, args.overlaps)}
    s = result["stitch"]
    print(f"{args.tokens}-token sequence, window {args.window}, shipped model; mean |vector| {s['mean_abs_vector']:.3f}")
    print("overlap 0, top-layer mean |diff| by distance from a cut: " +
          ", ".join(f"d={d}: {e:.3f}" for d, e in s["overlaps"][0]["by_distance"].items()))
    for v, row in s["overlaps"].items():
        print(f"overlap {v:>4}: mean |diff| {row['mean_abs_diff']:.4f} = {100 * row['relative']:.2f}% of mean |vector|")
    if args.pipeline_tokens:
        result["pipeline"] = p = long_sentence_run(args.pipeline_tokens, args.threads)
        print(f"one {p['tokens']}-token sentence through pipeline.run: {p['wall_s']:.1f} s, "
              f"windowed sentences {p['windowed_sentences']}, peak RSS {p['peak_rss_mb']:.0f} MB")
    if args.speed:
        from model.synthetic import random_bilm
        embedder = ElmoEmbedder() if args.config is None else ElmoEmbedder(model=random_bilm(args.config))
        result["speed"] = rows = windows_speed(embedder, args.speed, args.tokens, args.window, args.max_tokens,
                                               args.repeats)
        print(f"{args.speed} sentences of {args.tokens} tokens, window {args.window}, "
              f"{args.config or 'shipped'} model, {args.threads} thread(s):")
        for r in rows:
            print(f"  budget {r['budget']:>6}: one window per call {r['one window per call tokens_per_s']:6.0f}, "
                  f"one sentence at a time {r['one at a time tokens_per_s']:6.0f}, "
                  f"together {r['together tokens_per_s']:6.0f} tokens/s ({r['speed-up']:.2f}x one at a time)")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"windows{'_' + args.tag if args.tag else ''}.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
