"""Which LSTM loop is faster for a shape: the oneDNN loop against the bmm loop, per step, by LSTM width.

    .venv/bin/python -m benchmarks.loop_choice [--threads 1 2] [--rows 8 40 100] [--steps 100] [--out F]

Times model.lstm.run_lstm_layers (both directions of one layer, random weights, `rows` lanes live at each of
`steps` steps) with each loop, best of 5, for LSTM widths H (and projections P) from a near-free model's 16 up to the
published small shape's 1,024. Prints microseconds per step and the oneDNN loop's speed over the bmm loop's, and
writes JSON naming the machine: the measurement behind model.lstm.onednn_pays, the shape rule by which `auto`
picks a loop, and how often that rule picked the faster loop at each row count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.common import RESULTS, machine
from elmo_pipeline.model.lstm import (ONEDNN_MIN_GATE_WIDTH, ONEDNN_MIN_INPUT_WIDTH, LstmProjection, onednn_pays,
                                      run_lstm_layers, step_loop)

SHAPES = [(16, 512), (32, 8), (32, 128), (64, 16), (64, 64), (64, 256), (128, 16), (128, 128), (128, 512),
          (256, 32), (256, 256), (512, 64), (512, 128), (1024, 128)]     # (H, P)


def seconds_per_run(loop_name: str, H: int, P: int, rows: int, steps: int, repeats: int = 5) -> float:
    """Best wall seconds of one run_lstm_layers call: 2 directions, input width P, `rows` lanes for `steps` steps."""
    torch.manual_seed(0)
    layers = [LstmProjection(P, H, P, 3.0, 3.0) for _ in range(2)]
    x = torch.randn(2, rows * steps, P)
    h0, c0 = torch.zeros(2, rows, P), torch.zeros(2, rows, H)
    loop = step_loop(torch.device("cpu"), torch.float32, loop_name, compile_cell=False)
    best = float("inf")
    with torch.inference_mode():
        weights = loop.weights(layers)
        run_lstm_layers(loop, layers, weights, x, [rows] * steps, h0, c0)          # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            run_lstm_layers(loop, layers, weights, x, [rows] * steps, h0, c0)
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 40, 100], help="lanes live at every step")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/loop_choice.json; kept results "
                    "are named loop_choice_<machine kind>.json)")
    args = ap.parse_args()
    if not torch.backends.mkldnn.is_available():
        sys.exit("error: this torch build has no oneDNN: the bmm loop is the only one")
    rows_out = []
    print(f"{machine()}; auto picks oneDNN for 4H >= {ONEDNN_MIN_GATE_WIDTH} and D_in + P >= {ONEDNN_MIN_INPUT_WIDTH}")
    print(f"{'threads':>7} {'H':>5} {'P':>4} {'4H':>5} {'rows':>4} {'oneDNN us/step':>14} {'bmm us/step':>11} "
          f"{'oneDNN/bmm speed':>16}  auto picks")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for H, P in SHAPES:
            for rows in args.rows:
                t = {name: seconds_per_run(name, H, P, rows, args.steps) for name in ("onednn", "bmm")}
                pick = "onednn" if onednn_pays(LstmProjection(P, H, P, None, None)) else "bmm"
                r = {"threads": threads, "H": H, "P": P, "gate_width": 4 * H, "rows": rows, "steps": args.steps,
                     "onednn_us_per_step": 1e6 * t["onednn"] / args.steps, "bmm_us_per_step": 1e6 * t["bmm"] / args.steps,
                     "onednn_speed_over_bmm": t["bmm"] / t["onednn"], "auto_picks": pick,
                     "auto_speed_vs_faster": min(t.values()) / t[pick]}
                rows_out.append(r)
                print(f"{threads:>7} {H:>5} {P:>4} {4 * H:>5} {rows:>4} {r['onednn_us_per_step']:>14.1f} "
                      f"{r['bmm_us_per_step']:>11.1f} {r['onednn_speed_over_bmm']:>15.2f}x  {pick}", flush=True)
    summary = []
    for threads in args.threads:
        for rows in args.rows:
            cell = [r for r in rows_out if r["threads"] == threads and r["rows"] == rows]
            right = sum(r["auto_speed_vs_faster"] == 1.0 for r in cell)
            worst = min(r["auto_speed_vs_faster"] for r in cell)
            summary.append({"threads": threads, "rows": rows, "shapes": len(cell), "auto_picked_faster": right,
                            "worst_auto_speed_vs_faster": worst})
            print(f"{threads} thread(s), {rows} rows: auto picked the faster loop for {right} of {len(cell)} shapes "
                  f"(worst: {worst:.2f}x the faster)")
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.out or os.path.join(RESULTS, "loop_choice.json"), "w") as f:
        json.dump({"machine": machine(), "command": "python -m benchmarks.loop_choice " + " ".join(sys.argv[1:]),
                   "onednn_min_gate_width": ONEDNN_MIN_GATE_WIDTH,
                   "onednn_min_input_width": ONEDNN_MIN_INPUT_WIDTH, "summary": summary, "rows": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
