"""Where a GPU run's time goes: the embedder (what a user calls) under torch.profiler, then under cProfile.

    python -m benchmarks.gpu_profile [--device cuda] [--config original] [--sentences 2000] [--budget 16384]
        [--dtypes float32 bfloat16] [--lanes on off] [--pageable] [--eager-cell] [--top 25] [--out PATH]

Per dtype and lanes setting, random weights of the shape, the token cache warm, after a warm-up run of the same
sentences (compilation and caches out of the timing):
  wall     plain runs: seconds (the median of 3), tokens/s
  device   a run under torch.profiler: the device's busy seconds (the union of its kernels' and copies' intervals)
           and their share of that run's wall, kernel launches, the top kernels by device time, the top ops by
           their own host time
  host     a run under cProfile: the top functions by their own time (where the host's wall goes)
--pageable adds, beside each, the wall of the same run with each batch's results copied into a new
pageable array (`.cpu()`), as the embedder did before model.device.to_host: the lever side by side (wall only).
--eager-cell adds, after the profiled runs, the wall of the same runs with the bmm loop's eager cell (7 ops a step)
instead of the compiled one (one kernel, but every call through torch.compile's wrapper and guards on the host).
fp32 runs with TF32 off (fp32 as fp32). Writes benchmarks/results/gpu_profile_<device name>.json (or --out). On a CPU
(--device cpu) the device rows are empty: a check that the script works, not a result.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from collections import defaultdict
from unittest import mock

import torch

from benchmarks.common import RESULTS, device_tag, machine, wikitext_sentences
from benchmarks.model_speed import random_bilm
from elmo_pipeline.model import embedder as embedder_module
from elmo_pipeline.model.embedder import ElmoEmbedder


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run(embedder: ElmoEmbedder, sentences, budget: int, device: str) -> float:
    """Seconds of one pass of embed_sentences over `sentences`, every array delivered summed (as a user reads it)."""
    t = time.perf_counter()
    total = 0.0
    for a in embedder.embed_sentences(sentences, max_tokens=budget):
        total += float(a[-1, -1, 0])          # touch each delivered array (its copy is part of the path)
    _sync(device)
    return time.perf_counter() - t


def _median_wall(embedder: ElmoEmbedder, sentences, budget: int, device: str, runs: int = 3) -> float:
    """The median of `runs` passes' seconds (_run)."""
    return sorted(_run(embedder, sentences, budget, device) for _ in range(runs))[runs // 2]


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy / 1e6


def device_view(prof, wall: float, top: int) -> dict:
    """The device's busy time and top kernels, and the top host ops, from a finished torch.profiler run."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    intervals, launches = [], 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((e.time_range.start, e.time_range.end))
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us() / 1e6
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
    busy = _union_s(intervals)
    host = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return {"wall_s": wall, "device_busy_s": busy, "device_busy_share": busy / wall if wall else None,
            "kernel_launches": launches,
            "top_kernels": [{"name": n[:160], "count": c, "seconds": s}
                            for n, (c, s) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]],
            "top_host_ops": [{"name": a.key[:160], "count": a.count, "self_host_s": a.self_cpu_time_total / 1e6}
                             for a in host]}


def host_view(profiler: cProfile.Profile, top: int) -> list[dict]:
    """The top functions by own time of a finished cProfile run."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({fn})"[-160:],
                     "calls": ncalls, "own_s": tottime, "cumulative_s": cumtime})
    return sorted(rows, key=lambda r: -r["own_s"])[:top]


def _pageable(t: torch.Tensor):
    """A batch's results copied into a new pageable array (the embedder's delivery before to_host)."""
    return t.float().cpu().numpy()


def profile_one(config: str, sentences, budget: int, device: str, dtype: torch.dtype, lanes: bool,
                warm: list[list[str]], top: int, pageable: bool = False, eager_cell: bool = False) -> dict:
    model = random_bilm(config).to(device=device, dtype=dtype)
    embedder = ElmoEmbedder(model=model, device=device, lanes=lanes)
    list(embedder.embed_sentences(warm, max_tokens=budget))          # token cache, compilation, allocator
    _run(embedder, sentences, budget, device)                        # warm-up: the same sentences
    wall = _median_wall(embedder, sentences, budget, device)
    tokens = sum(len(s) for s in sentences)
    pageable_wall = None
    if pageable:
        with mock.patch.object(embedder_module, "to_host", _pageable):
            _run(embedder, sentences, budget, device)
            pageable_wall = _median_wall(embedder, sentences, budget, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        prof_wall = _run(embedder, sentences, budget, device)
    dev = device_view(prof, prof_wall, top)
    profiler = cProfile.Profile()
    profiler.enable()
    cprof_wall = _run(embedder, sentences, budget, device)
    profiler.disable()
    eager_wall = None
    if eager_cell:          # last: switching the cell re-makes the loop's weights (the cell is part of their key)
        was, model.compile_cell = model.compile_cell, False
        try:
            _run(embedder, sentences, budget, device)
            eager_wall = _median_wall(embedder, sentences, budget, device)
        finally:
            model.compile_cell = was
    row = {"dtype": str(dtype).removeprefix("torch."), "lanes": lanes, "budget": budget, "tokens": tokens,
           "sentences": len(sentences), "wall_s": wall, "tokens_per_s": tokens / wall,
           "pageable_wall_s": pageable_wall, "pageable_tokens_per_s": tokens / pageable_wall if pageable else None,
           "eager_cell_wall_s": eager_wall, "eager_cell_tokens_per_s": tokens / eager_wall if eager_cell else None,
           "device": dev, "host": {"wall_s": cprof_wall, "top_functions": host_view(profiler, top)}}
    before = f" (new pageable arrays: {tokens / pageable_wall:,.0f})" if pageable else ""
    before += f" (eager cell: {tokens / eager_wall:,.0f})" if eager_cell else ""
    print(f"{row['dtype']:<9} lanes {'on ' if lanes else 'off'} {tokens / wall:10,.0f} tokens/s{before}; device busy "
          f"{dev['device_busy_share'] or 0:.1%} of the profiled run ({dev['kernel_launches']} launches)", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="original")
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lanes", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--pageable", action="store_true",
                    help="also time each run with its results copied into new pageable arrays (the lever's before)")
    ap.add_argument("--eager-cell", action="store_true",
                    help="also time each run with the bmm loop's eager cell instead of the compiled one")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_profile_<device>.json)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sentences = wikitext_sentences(args.sentences)
    warm = wikitext_sentences(args.sentences, split="train")
    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    rows = [profile_one(args.config, sentences, args.budget, args.device, getattr(torch, dt), lanes == "on", warm,
                        args.top, args.pageable, args.eager_cell)
            for dt in args.dtypes for lanes in args.lanes]
    report = {"device": args.device, "device_name": name, "machine": machine(), "torch": torch.__version__,
              "config": args.config, "runs": rows}
    os.makedirs(RESULTS, exist_ok=True)
    path = args.out or os.path.join(RESULTS, "gpu_profile_" + device_tag(name) + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
