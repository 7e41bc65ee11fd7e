"""Model-only throughput: tokens/s of the biLM on real sentences, against a GEMM ceiling measured
in the same run. Random weights of the published shapes (model/synthetic.py).

    .venv/bin/python benchmarks/model_speed.py --configs small medium original --threads 2 \
        --max-tokens 4096 --sentences 2000 [--device cpu|cuda] [--dtype float32|bfloat16]

Prints a table and writes benchmarks/results/model_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.common import (RESULTS, flops_per_token, gemm_ceiling_gflops, machine, token_budget_batches,
                               wikitext_sentences)
from model.char_ids import batch_char_ids
from model.synthetic import random_bilm


def measure(config: str, sentences, max_tokens: int, device: str, dtype: torch.dtype) -> dict:
    model = random_bilm(config).to(device=device, dtype=dtype)
    batches = token_budget_batches(sentences, max_tokens)
    inputs = []
    for idx in batches:
        ids, lengths = batch_char_ids([sentences[i] for i in idx])
        inputs.append((torch.from_numpy(ids).to(device), torch.from_numpy(lengths)))
    n_tokens = sum(len(s) for s in sentences)
    with torch.inference_mode():
        model(*inputs[0])                                   # warm-up
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for ids, lengths in inputs:
            out, _ = model(ids, lengths)
            out = out.float().cpu()                         # results back on the host, as a user needs them
        wall = time.perf_counter() - t
    fpt = flops_per_token(model.opts)
    return {"config": config, "tokens": n_tokens, "sentences": len(sentences), "batches": len(batches),
            "wall_s": wall, "tokens_per_s": n_tokens / wall, "flops_per_token": fpt,
            "gflops": n_tokens / wall * fpt / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["small", "medium", "original"])
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sentences = wikitext_sentences(args.sentences)
    ceiling = gemm_ceiling_gflops(args.threads, dtype=dtype, device=args.device)
    rows = []
    for config in args.configs:
        for budget in args.max_tokens:
            r = measure(config, sentences, budget, args.device, dtype)
            r.update(max_tokens=budget, threads=args.threads, device=args.device, dtype=args.dtype,
                     gemm_ceiling_gflops=ceiling, fraction_of_ceiling=r["gflops"] / ceiling)
            rows.append(r)
            print(f"{config:<9} budget {budget:>6}  {r['tokens_per_s']:>9.0f} tokens/s  "
                  f"{r['gflops']:>7.1f} GFLOP/s = {100 * r['fraction_of_ceiling']:5.1f}% of GEMM {ceiling:.0f}",
                  flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = f"model_speed_{args.device.split(':')[0]}_{args.dtype}.json"
    with open(os.path.join(RESULTS, name), "w") as f:
        json.dump({"machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
