"""The LSTM step's GEMMs alone, fp32 against bf16, by rows per step and by where the weights come from: how
close bf16 can get to 2x fp32 inside the model's own calls on this CPU.

One step of model/bilm.py's oneDNN loop for one direction is three oneDNN linears on prepacked weights
(torch.ops.mkldnn._linear_pointwise, as model.lstm_loops.onednn_loop calls them), for rows m (the lanes live at that step):
  gates i, f, o   (m, D+P) x (D+P, 3H), sigmoid fused
  gate j          (m, D+P) x (D+P, H), tanh fused
  projection      (m, H) x (H, P)
Weights placed two ways:
  cached    one direction's weights, step after step (they stay in the caches as far as they fit: a
            micro-benchmark's usual best case)
  streamed  the weights of both directions of every layer in turn, as the model reads them (each step's
            weights come from memory: 2 layers x 2 directions x 75 MB in fp32 for the original shape)
Per row: GFLOP/s (median of --rounds rounds, fp32 and bf16 interleaved), the share of each dtype's square-GEMM
ceiling measured in the same run (benchmarks/common.py), and bf16 / fp32.

    .venv/bin/python -m benchmarks.step_gemms [--config original] [--rows 16 32 64 128 256 512] [--threads 2]
        [--rounds 5] [--tag NAME]
Prints the table; writes benchmarks/results/step_gemms_<tag>.json naming the machine (tag default: vendor and
CPU family). CPU with oneDNN bf16 only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.common import RESULTS, gemm_rates_gflops, machine
from model.synthetic import PUBLISHED_OPTIONS
from model.options import parse_options

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PLACES = ("cached", "streamed")


def step_weights(H: int, P: int, D: int, dtype: torch.dtype, sets: int, seed: int = 0) -> list[list]:
    """`sets` directions' prepacked step weights: per direction [(weight, bias, k, n, activation)] x 3."""
    g = torch.Generator().manual_seed(seed)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    out = []
    for _ in range(sets):
        calls = []
        for n, k, act in ((3 * H, D + P, "sigmoid"), (H, D + P, "tanh"), (P, H, "none")):
            w = (torch.rand(n, k, generator=g) * 2 - 1) / k ** 0.5
            calls.append((reorder(w.to(dtype)), torch.zeros(n, dtype=dtype) if act != "none" else None, k, n, act))
        out.append(calls)
    return out


def step_rate(weights: list[list], m: int, gflop: float = 10.0) -> float:
    """GFLOP/s of passes over every direction in `weights` at m rows, about `gflop` GFLOP in all (one warm-up
    pass first)."""
    lin = torch.ops.mkldnn._linear_pointwise
    dtype = weights[0][0][0].dtype
    x = {k: torch.rand(m, k).to(dtype) for _, _, k, _, _ in weights[0]}
    flops = sum(2 * m * k * n for _, _, k, n, _ in weights[0]) * len(weights)
    steps = max(1, int(gflop * 1e9 // flops))

    def one():
        for direction in weights:
            for w, b, k, _, act in direction:
                lin(x[k], w, b, act, [], "")
    one()
    t = time.perf_counter()
    for _ in range(steps):
        one()
    return flops * steps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="original")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        sys.exit("error: this CPU has no oneDNN bf16 (see `elmo-pipeline doctor`)")
    torch.set_num_threads(args.threads)
    o = parse_options(PUBLISHED_OPTIONS[args.config])
    H, P = o.lstm_dim, o.projection_dim
    ceilings = {name: gemm_rates_gflops(args.threads, dtype=dt)["onednn"] for name, dt in DTYPES.items()}
    weights = {(name, place): step_weights(H, P, P, dt, 1 if place == "cached" else 2 * o.n_layers)
               for name, dt in DTYPES.items() for place in PLACES}
    rows = []
    print(f"{machine()}; {args.config}: H={H}, P={P}; {args.threads} threads; ceilings (square 2048, oneDNN) "
          f"fp32 {ceilings['fp32']:.0f}, bf16 {ceilings['bf16']:.0f} GFLOP/s")
    print(f"{'weights':<9} {'rows':>5} {'fp32 GFLOP/s':>13} {'of ceiling':>10} {'bf16 GFLOP/s':>13} {'of ceiling':>10} "
          f"{'bf16/fp32':>9}")
    for place in PLACES:
        for m in args.rows:
            rates = {name: [] for name in DTYPES}
            for _ in range(args.rounds):
                for name in DTYPES:
                    rates[name].append(step_rate(weights[(name, place)], m))
            med = {name: statistics.median(v) for name, v in rates.items()}
            row = {"weights": place, "rows": m, **{f"{n}_gflops": med[n] for n in DTYPES},
                   **{f"{n}_share": med[n] / ceilings[n] for n in DTYPES}, "bf16_over_fp32": med["bf16"] / med["fp32"]}
            rows.append(row)
            print(f"{place:<9} {m:>5} {med['fp32']:>13.0f} {100 * row['fp32_share']:>9.1f}% {med['bf16']:>13.0f} "
                  f"{100 * row['bf16_share']:>9.1f}% {row['bf16_over_fp32']:>8.2f}x", flush=True)
    print(f"ceiling ratio bf16/fp32: {ceilings['bf16'] / ceilings['fp32']:.2f}x")
    from model.hardware import cpu_info
    cpu = cpu_info()
    tag = args.tag or f"{(cpu['name'] or 'cpu').split()[0].lower()}_f{cpu['family']}"
    path = os.path.join(RESULTS, f"step_gemms_{tag}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), "config": args.config, "threads": args.threads, "rounds": args.rounds,
                   "ceilings_gflops": ceilings, "rows": rows}, f, indent=2)
    print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
