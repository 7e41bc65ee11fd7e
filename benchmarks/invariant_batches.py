"""Where the batch-invariant path costs: BiLM.forward_tokens on one batch of WikiText-2 sentences, previous fast
path vs batch_invariant=True, by batch shape. Random weights of the published shapes; token encoder included
(no token cache). CPU time (time.process_time) medians of --repeats runs, the two paths interleaved, so that
other load on a shared machine slows both alike.

    .venv/bin/python -m benchmarks.invariant_batches --configs small original --threads 1 --repeats 5 \
        [--batches b1 b7 b64 budget4096 budget16384]

b1: one sentence (25 tokens); b7 / b64: that many sentences of 15-40 tokens; budgetN: WikiText-2 sentences
length-sorted and cut by a budget of N padded slots, the batch holding the median sentence. Writes
benchmarks/results/invariant_batches_<configs>_<threads>t.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from benchmarks.common import RESULTS, machine, wikitext_sentences
from model.batching import plan_batches
from model.char_ids import distinct_char_ids
from model.synthetic import random_bilm


def batch_of(kind: str, sentences: list[list[str]]) -> list[list[str]]:
    rng = random.Random(0)
    if kind == "b1":
        return [next(s for s in sentences if len(s) == 25)]
    if kind in ("b7", "b64"):
        pool = [s for s in sentences if 15 <= len(s) <= 40]
        return rng.sample(pool, int(kind[1:]))
    budget = int(kind.removeprefix("budget"))
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    batches = plan_batches([len(sentences[i]) for i in order], budget)
    mid = order[len(order) // 2]
    idx = next(b for b in batches if order.index(mid) in b)
    return [sentences[order[i]] for i in idx]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["small", "original"])
    ap.add_argument("--batches", nargs="+", default=["b1", "b7", "b64", "budget4096", "budget16384"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sentences = wikitext_sentences(2000)
    rows = []
    for config in args.configs:
        model = random_bilm(config)
        for kind in args.batches:
            batch = batch_of(kind, sentences)
            inputs = [torch.from_numpy(a) for a in distinct_char_ids(batch, model.opts.max_characters_per_token)]
            steps = max(len(s) for s in batch) + 2
            times: dict[bool, list[float]] = {False: [], True: []}
            with torch.inference_mode():
                for inv in (False, True):
                    model.forward_tokens(*inputs, None, batch_invariant=inv)          # warm-up
                for _ in range(args.repeats):
                    for inv in (False, True):
                        t = time.process_time()
                        model.forward_tokens(*inputs, None, batch_invariant=inv)
                        times[inv].append(time.process_time() - t)
            tokens = sum(len(s) for s in batch)
            fast, inv = statistics.median(times[False]), statistics.median(times[True])
            r = {"config": config, "batch": kind, "sentences": len(batch), "tokens": tokens, "steps": steps,
                 "threads": args.threads, "repeats": args.repeats, "fast_cpu_s": fast, "invariant_cpu_s": inv,
                 "fast_tokens_per_cpu_s": tokens / fast, "invariant_tokens_per_cpu_s": tokens / inv,
                 "tokens_per_cpu_s_vs_fast_path": fast / inv - 1, "all_fast_cpu_s": times[False],
                 "all_invariant_cpu_s": times[True]}
            rows.append(r)
            print(f"{config:<9} {kind:<12} {len(batch):>4} sentences {tokens:>6} tokens: fast {tokens / fast:>8.0f} "
                  f"tokens/CPU s, invariant {tokens / inv:>8.0f}  {100 * r['tokens_per_cpu_s_vs_fast_path']:+6.1f}%",
                  flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"invariant_batches_{'_'.join(args.configs)}_{args.threads}t.json"), "w") as f:
        json.dump({"machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
