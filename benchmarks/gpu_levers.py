"""What the GPU path could still gain, by measurement (issue: the GPU path measured): CUDA graphs for the LSTM
step, and pinned host buffers for a batch's results.

  step   one step of model/bilm.py's bmm loop for both directions of a layer (the recurrent baddbmm_, the cell,
         the projection bmm, its clip), at R rows, S steps in a row: issued eagerly (a kernel launch per op) against
         the same S steps captured once in a CUDA graph and replayed (one launch); ms per step and the share that
         launches cost, fp32 (TF32 off) and bf16; on a GPU with each cell (model.lstm_loops: the compiled kernel,
         whose every call passes torch.compile's guards on the host, and the eager cell's 7 in-place ops).
  copy   a batch's results (budget x 3 layers x 2P fp32) device -> host: into pageable memory, into pinned
         memory, and pinned with non_blocking on a side stream while S steps run on the main one (how much of
         the copy the compute hides); and as a result is delivered, its host array made by each copy: a new
         pageable array (`.cpu()`, fresh pages faulted in as the copy lands) against model.device.to_host (page-
         locked memory from torch's caching host allocator, reused).

    python -m benchmarks.gpu_levers [--device cuda] [--config original] [--rows 16 64 256] [--steps 64]
        [--budget 16384] [--tag NAME] [--out PATH]
Writes benchmarks/results/gpu_levers_<device name>[_TAG].json (or --out) naming the device. On a CPU (--device cpu) only the
eager step runs (graphs and pinned copies need CUDA): a check that the script works, not a result.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.common import RESULTS, device_tag, machine
from elmo_pipeline.model.device import to_host
from elmo_pipeline.model.lstm import options_from_env
from elmo_pipeline.model.lstm_loops import cell_for
from elmo_pipeline.model.options import parse_options
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_steps(H: int, P: int, rows: int, steps: int, dtype: torch.dtype, device: str, clip: float = 3.0,
               compile_cell: bool | None = None):
    """A function running `steps` LSTM steps of both directions at `rows` rows in place on static buffers (so a
    CUDA graph can capture it): per step gates = xw + h @ W_rec, the cell, h = clip(out @ W_proj). compile_cell:
    the cell cell_for gives (None: as a model built here runs it)."""
    g = torch.Generator().manual_seed(0)
    compile_cell = options_from_env()[1] if compile_cell is None else compile_cell
    cell = cell_for(torch.device(device), compile_cell)

    def rand(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=g) * 2 - 1) * scale).to(device=device, dtype=dtype)
    w_rec, w_proj = rand(2, P, 4 * H, scale=P ** -0.5), rand(2, H, P, scale=H ** -0.5)
    xw, gates = rand(2, rows, 4 * H), torch.empty(2, rows, 4 * H, device=device, dtype=dtype)
    h, c = rand(2, rows, P), rand(2, rows, H)
    out, y = torch.empty(2, rows, H, device=device, dtype=dtype), torch.empty(2, rows, P, device=device, dtype=dtype)

    def run():
        for _ in range(steps):
            gates.copy_(xw)                      # the model's gates are rows of its input projection: no copy there
            gates.baddbmm_(h, w_rec)
            c_new, o = cell(gates, c, clip, out)
            c.copy_(c_new)
            torch.bmm(o, w_proj, out=y)
            y.clamp_(-clip, clip)
            h.copy_(y)
    return run


def time_ms(fn, device: str, repeats: int = 5) -> float:
    """Median wall ms of fn() (synchronized), after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def step_rows(device: str, H: int, P: int, rows: list[int], steps: int) -> list[dict]:
    out = []
    cells = (True, False) if device.startswith("cuda") else (False,)
    for dt, r, compiled in ((dt, r, c) for dt in ("float32", "bfloat16") for r in rows for c in cells):
        dtype = getattr(torch, dt)
        run = make_steps(H, P, r, steps, dtype, device, compile_cell=compiled)
        eager = time_ms(run, device)
        row = {"dtype": dt, "rows": r, "steps": steps, "cell": "compiled" if compiled else "eager",
               "eager_ms_per_step": eager / steps}
        if device.startswith("cuda"):
            try:
                for _ in range(3):               # compile and warm up outside the capture
                    run()
                _sync(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                replay = time_ms(graph.replay, device)
                row.update(graph_ms_per_step=replay / steps, launch_share=1 - replay / eager)
            except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                row["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        out.append(row)
        print(row, flush=True)
    return out


def copy_rows(device: str, H: int, P: int, budget: int, steps: int) -> dict:
    """Device -> host copies of budget x 3 x 2P fp32 results: GB/s pageable and pinned, and the overlap."""
    n = budget * 3 * 2 * P
    src = torch.rand(n, device=device)
    pageable, pinned = torch.empty(n), torch.empty(n, pin_memory=True)
    gb = n * 4 / 1e9
    res = {"bytes": n * 4,
           "pageable_gb_s": gb / (time_ms(lambda: pageable.copy_(src), device) / 1e3),
           "pinned_gb_s": gb / (time_ms(lambda: pinned.copy_(src, non_blocking=True), device) / 1e3),
           "new_pageable_array_gb_s": gb / (time_ms(lambda: src.cpu().numpy(), device) / 1e3),
           "to_host_gb_s": gb / (time_ms(lambda: to_host(src), device) / 1e3)}
    run = make_steps(H, P, 64, steps, torch.bfloat16, device)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pinned.copy_(src, non_blocking=True)
        run()
        torch.cuda.current_stream().wait_stream(side)
    compute = time_ms(run, device)
    copy = time_ms(lambda: pinned.copy_(src, non_blocking=True), device)
    together = time_ms(both, device)
    res.update(compute_ms=compute, copy_ms=copy, together_ms=together,
               hidden_share_of_copy=max(0.0, min(1.0, (compute + copy - together) / copy)))
    print(res, flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_levers", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="original")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_levers_<device>.json)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    o = parse_options(PUBLISHED_OPTIONS[args.config])
    H, P = o.lstm_dim, o.projection_dim
    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    report = {"device": args.device, "device_name": name, "machine": machine(), "torch": torch.__version__,
              "config": args.config, "step": step_rows(args.device, H, P, args.rows, args.steps)}
    if args.device.startswith("cuda"):
        try:
            report["copy"] = copy_rows(args.device, H, P, args.budget, args.steps)
        except Exception as e:  # noqa: BLE001 - recorded beside the step rows
            report["copy_error"] = f"{type(e).__name__}: {e}"[:500]
    os.makedirs(RESULTS, exist_ok=True)
    path = args.out or os.path.join(RESULTS, "gpu_levers_" + device_tag(name)
                                    + (f"_{args.tag}" if args.tag else "") + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {os.path.relpath(path)}")
    report["path"] = path
    return report


if __name__ == "__main__":
    main()
