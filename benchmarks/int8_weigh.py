"""int8 (u8 x s8, AVX512-VNNI) against bf16 and fp32 for the biLM's large GEMMs on this CPU: GOP/s and error.

Per shape (m, k) x (k, n), GOP/s = 2mkn / t, best over --rounds round-robin passes (a shared machine):
  fp32, bf16      torch.ops.mkldnn._linear_pointwise with a prepacked weight (as model/bilm.py's LSTM step)
  int8 gemm       torch.ops.onednn.qlinear_pointwise on already-quantized u8 activations, per-channel s8
                  weight (onednn.qlinear_prepack), fp32 output: the GEMM alone
  int8+quant      the same plus dynamic per-tensor u8 quantization of the fp32 activations (aminmax, round)
  int8 dyn        torch.ops.quantized.linear_dynamic (fp32 in and out, quantizes inside), engine --engine
  _int_mm         torch._int_mm, s8 x s8 -> s32, no scales at all (a raw ceiling)
and the relative error ||y - y_fp32|| / ||y_fp32|| of bf16 and of int8 (int8+quant's output) for activations
randn * --x-scale and xavier-normal weights.

    .venv/bin/python -m benchmarks.int8_weigh [--threads 2] [--rounds 5] [--seconds 0.05] [--engine onednn] [--tag NAME]
Prints the table; writes benchmarks/results/int8_weigh_<tag>.json (tag default: vendor and CPU family).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

from benchmarks.common import RESULTS, machine

# (label, m, k, n): the LSTM gate GEMMs (4 gates x 4096 cells, input 1024 = x|h), the projection, a square.
SHAPES = [(f"gates m={m}", m, 1024, 16384) for m in (64, 256, 2048)] + \
         [(f"proj m={m}", m, 4096, 512) for m in (64, 256, 2048)] + [("square 2048", 2048, 2048, 2048)]
COLUMNS = ["fp32", "bf16", "int8 gemm", "int8+quant", "int8 dyn", "_int_mm"]


def best_rate(call, flops: float, seconds: float) -> float:
    """Best GOP/s of repeated calls within `seconds` (at least one timed call)."""
    best, n, end = 0.0, 0, time.perf_counter() + seconds
    while n < 1 or time.perf_counter() < end:
        t = time.perf_counter()
        call()
        best, n = max(best, flops / (time.perf_counter() - t) / 1e9), n + 1
    return best


def quantize_u8(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """Dynamic per-tensor asymmetric u8 quantization (range widened to include 0): (q, scale, zero point)."""
    lo, hi = torch.aminmax(x)
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max(hi - lo, 1e-8) / 255
    zp = int(round(-lo / scale))
    return x.div(scale).add_(zp).round_().clamp_(0, 255).to(torch.uint8), scale, zp


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float(f"{float((y.float() - ref).norm() / ref.norm()):.3e}")


def setup(m: int, k: int, n: int, x_scale: float, engine: str) -> tuple[dict, dict]:
    """The calls of every column for one (m, k) x (k, n) (each run once: warm-up), and the relative errors."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    x = torch.randn(m, k, generator=g) * x_scale
    w = torch.randn(n, k, generator=g) * (2.0 / (k + n)) ** 0.5
    lin = torch.ops.mkldnn._linear_pointwise
    w32 = torch.ops.mkldnn._reorder_linear_weight(w)
    xb, wb = x.bfloat16(), torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
    w_scale = w.abs().amax(1).clamp_min(1e-8) / 127          # symmetric per output channel
    w_zp = torch.zeros(n, dtype=torch.int64)
    wq = torch.round(w / w_scale[:, None]).clamp_(-127, 127).to(torch.int8)
    wq_packed = torch.ops.onednn.qlinear_prepack(wq, [m, k])

    def q_gemm(qx, s, zp):
        return torch.ops.onednn.qlinear_pointwise(qx, s, zp, wq_packed, w_scale, w_zp, None, 1.0, 0,
                                                  torch.float32, "none", [], "")

    torch.backends.quantized.engine = engine
    dyn_packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(w, w_scale.double(), w_zp, 0, torch.qint8), None)
    qx, s, zp = quantize_u8(x)
    xs8, wt8 = torch.randint(-127, 128, (m, k), dtype=torch.int8), wq.t().contiguous()
    calls = {"fp32": lambda: lin(x, w32, None, "none", [], ""),
             "bf16": lambda: lin(xb, wb, None, "none", [], ""),
             "int8 gemm": lambda: q_gemm(qx, s, zp),
             "int8+quant": lambda: q_gemm(*quantize_u8(x)),
             "int8 dyn": lambda: torch.ops.quantized.linear_dynamic(x, dyn_packed, False),
             "_int_mm": lambda: torch._int_mm(xs8, wt8)}
    out = {}
    for name, call in list(calls.items()):
        try:
            out[name] = call()
        except RuntimeError as e:  # an op this build or CPU lacks
            del calls[name]
            print(f"{name} ({m}x{k}x{n}) failed: {str(e).splitlines()[0]}", file=sys.stderr)
    ref = out["fp32"]
    return calls, {c: rel(out[o], ref) for c, o in (("bf16", "bf16"), ("int8", "int8+quant"), ("int8 dyn", "int8 dyn"))
                   if o in out}


def default_tag() -> str:
    from model.hardware import cpu_info
    c = cpu_info()
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(c.get("vendor") or "", c.get("arch") or "cpu")
    return f"{vendor}_f{c['family']}" if c.get("family") is not None else vendor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.int8_weigh", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="round-robin passes over all (shape, column); best kept")
    ap.add_argument("--seconds", type=float, default=0.05, help="timing budget per (shape, column) and round")
    ap.add_argument("--x-scale", type=float, default=0.5, help="activations are randn * this")
    ap.add_argument("--engine", default="onednn", help="torch.backends.quantized.engine for 'int8 dyn'")
    ap.add_argument("--tag", default=None, help="results file suffix (default: vendor and CPU family)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor, torch.quantize_per_channel.*")
    t0, rows, cases = time.perf_counter(), [], []
    for label, m, k, n in SHAPES:
        calls, errors = setup(m, k, n, args.x_scale, args.engine)
        rows.append({"shape": label, "m": m, "k": k, "n": n, "gops": dict.fromkeys(COLUMNS), "rel_err": errors})
        cases.append((calls, 2.0 * m * k * n, rows[-1]["gops"]))
    for _ in range(args.rounds):  # round robin: a neighbour's burst of load hits one round, not one column
        for calls, flops, gops in cases:
            for name, call in calls.items():
                gops[name] = round(max(gops[name] or 0.0, best_rate(call, flops, args.seconds)), 1)
    for r in rows:
        g8, gq = r["gops"]["int8 gemm"], r["gops"]["int8+quant"]
        r["quant_share"] = round(1 - gq / g8, 3) if g8 and gq else None  # of int8+quant's time
    print(f"{machine()}; {args.threads} threads; GOP/s (2mkn/t), relative error vs fp32 (x = randn*{args.x_scale})")
    print("| shape | " + " | ".join(COLUMNS) + " | err bf16 | err int8 | quant share |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    for r in rows:
        g = r["gops"]
        print(f"| {r['shape']} ({r['m']}x{r['k']}x{r['n']}) | " + " | ".join(
            "-" if g[c] is None else f"{g[c]:.0f}" for c in COLUMNS) +
            f" | {r['rel_err']['bf16']:.2e} | {r['rel_err']['int8']:.2e} | {r['quant_share'] or 0:.0%} |")
    tag = args.tag or default_tag()
    os.makedirs(RESULTS, exist_ok=True)
    name = os.path.join(RESULTS, f"int8_weigh_{tag}.json")
    command = "python -m benchmarks.int8_weigh " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(name, "w") as f:
        json.dump({"machine": machine(), "command": command.strip(), "threads": args.threads, "engine": args.engine,
                   "rounds": args.rounds, "seconds_per_round": args.seconds, "x_scale": args.x_scale,
                   "columns": COLUMNS, "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}, f, indent=1)
    print(f"-> {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
