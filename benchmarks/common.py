"""Shared pieces of the benchmarks: real sentences, FLOP counts, a GEMM ceiling."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time

import torch

from elmo_pipeline.model.options import BiLMOptions

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared")
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)


def wikitext_sentences(n: int, split: str = "valid") -> list[list[str]]:
    """The first n sentences (lines cut at ' . ', headings and blanks skipped) of WikiText-2."""
    path = os.path.join(SHARED, "data", "wikitext-2", f"{split}.txt")
    out: list[list[str]] = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("="):
                continue
            for part in line.split(" . "):
                toks = part.split()
                if toks:
                    out.append(toks + ["."] if toks[-1] != "." else toks)
                if len(out) == n:
                    return out
    return out


def flops_per_token(o: BiLMOptions) -> int:
    """Ideal multiply-add FLOPs (x2) per token: char CNN over max_chars characters, highway,
    projection and both LSTM directions; no padding, no boundary tokens, elementwise ops ignored."""
    total = 0
    if o.char_cnn is not None:
        E, C, F = int(o.char_cnn["embedding"]["dim"]), o.max_characters_per_token, o.n_filters
        total += sum(2 * (C - w + 1) * w * E * n for w, n in o.filters)
        total += int(o.char_cnn.get("n_highway") or 0) * 2 * F * 2 * F
        if F != o.projection_dim:
            total += 2 * F * o.projection_dim
    return total + lstm_flops_per_token(o)


def lstm_flops_per_token(o: BiLMOptions) -> int:
    """The LSTM layers' share of flops_per_token: both directions' input, recurrent and projection GEMMs."""
    P, H = o.projection_dim, o.lstm_dim
    return 2 * o.n_layers * (2 * (P + P) * 4 * H + 2 * H * P)


def gemm_ceiling_gflops(threads: int, n: int = 2048, seconds: float = 2.0, dtype=torch.float32,
                        device: str = "cpu") -> float:
    """Measured square-GEMM GFLOP/s on this device with `threads` threads: the best of torch.mm (MKL on a
    CPU, cuBLAS on a GPU) and, on a CPU, oneDNN's linear with a prepacked weight (on AMD CPUs MKL's sgemm
    reaches about half of the fp32 rate oneDNN does, so torch.mm alone understates the CPU's ceiling)."""
    return max(gemm_rates_gflops(threads, n, seconds, dtype, device).values())


def gemm_rates_gflops(threads: int, n: int = 2048, seconds: float = 2.0, dtype=torch.float32,
                      device: str = "cpu") -> dict[str, float]:
    """Square-GEMM GFLOP/s per implementation: {'torch.mm': ..., 'onednn': ... (CPU with oneDNN)}, best of
    the runs within `seconds` each."""
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    calls = {"torch.mm": lambda: torch.mm(a, b)}
    if device == "cpu" and torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        w = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
    rates = {}
    for name, call in calls.items():
        call()
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            call()
            if device != "cpu":
                torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
        rates[name] = best
    return rates


def cpu_name() -> str:
    """The CPU's model name and family (model.hardware.cpu_info: 'AMD EPYC' names both this project's AMD
    kinds, family 23 = Zen 1, 26 = Zen 5), with AVX-512 or its absence and native bf16 (AVX512_BF16, AMX) noted:
    GEMM speeds depend on all."""
    from elmo_pipeline.model.hardware import cpu_info
    cpu = cpu_info()
    if cpu["flags"] is None:
        return platform.processor() or platform.machine()
    family = f" (family {cpu['family']})" if cpu["family"] is not None else ""
    flags = cpu["flags"]
    bf16 = [name for flag, name in (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    return (cpu["name"] or "") + family + (", AVX-512" if "avx512f" in flags else ", no AVX-512") + \
        "".join(f" + {b}" for b in bf16)


def machine() -> str:
    return f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"


def wiki_lines(split: str, n: int = 0) -> list[str]:
    with open(os.path.join(SHARED, "data", "wikitext-2", f"{split}.txt"), encoding="utf-8", newline="\n") as f:
        lines = f.read().split("\n")
    return lines[:n] if n else lines


def run(args: list[str], children: bool = False) -> dict:
    """One pipeline run in a fresh process: wall seconds, peak RSS (MB: the largest of the process and its waited-for
    children), the summary line; `children`: also the process's own and each descendant's peak RSS (MB, polled
    every 0.1 s; those over 20 MB: FnApiRunner's multi_processing workers, not the shells that start them)."""
    import threading

    import psutil
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=REPO)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, int] = {}
    stop = threading.Event()

    def poll():
        while children and not stop.is_set():
            try:
                launcher = psutil.Process(p.pid)
                for c in [launcher, *launcher.children(recursive=True)]:
                    seen[c.pid] = max(seen.get(c.pid, 0), c.memory_info().rss)
            except psutil.Error:
                pass
            stop.wait(0.1)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(err[-3000:])
    out = {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "summary": err.strip().splitlines()[-1]}
    if children:
        out["own_peak_rss_mb"] = seen.pop(p.pid, 0) / 2 ** 20
        out["children_peak_rss_mb"] = sorted((v / 2 ** 20 for v in seen.values() if v > 20 << 20), reverse=True)
    return out


@contextlib.contextmanager
def trees(baseline: str | None, tmp: str):
    """{label: source tree}: this tree ("this tree"), and with a baseline revision a git worktree of it under tmp
    (removed after), to run side by side with PYTHONPATH=<tree>."""
    out = {"this tree": REPO}
    base_dir = os.path.join(tmp, "baseline") if baseline else None
    if base_dir:
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", base_dir, baseline], check=True)
        out[baseline] = base_dir
    try:
        yield out
    finally:
        if base_dir:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_dir], check=False)


def write_result(report: dict, out: str | None, tool: str) -> str:
    """report as JSON to `out` (None: results/<tool>_<kind>.json, kind_tag()), folders made; prints and returns the
    path."""
    out = out or os.path.join(RESULTS, f"{tool}_{kind_tag()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")
    return out


def kind_tag() -> str:
    """The machine kind in a result file's name: zen1, zen2, zen3, zen4, zen5 (AMD, by the core's family and model:
    family 23 is Zen 1 below model 0x30, Zen 2 from it; family 25 is Zen 4 at models 0x10-0x1f, 0x60-0x7f and
    0xa0-0xaf, Zen 3 at the others; family 26 is Zen 5), intel, intel_amx (an Intel CPU with AMX-BF16 tiles) or
    cpu."""
    from elmo_pipeline.model.hardware import cpu_info
    cpu = cpu_info()
    family, model = cpu.get("family"), cpu.get("model") or 0
    zen = {23: "zen1" if model < 0x30 else "zen2", 25: "zen4" if model >> 4 in (0x1, 0x6, 0x7, 0xa) else "zen3",
           26: "zen5"}.get(family) if "AMD" in (cpu.get("name") or "") else None
    if zen or "Intel" not in (cpu.get("name") or ""):
        return zen or "cpu"
    return "intel_amx" if "amx_bf16" in (cpu.get("flags") or []) else "intel"


def device_tag(name: str) -> str:
    """A device's name as result files carry it ('NVIDIA H200' -> 'NVIDIA_H200')."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def stage_seconds(metrics_file: str) -> dict[str, float]:
    """The run's own seconds from its metrics.prom: each stage's (read, tokenize, batch, embed, write) and the run's
    (the rest of a process's wall is its start-up: imports, the runner, the workers)."""
    out = {}
    with open(metrics_file, encoding="utf-8") as f:
        for line in f:
            m = re.match(r'elmo_pipeline_(?:stage_seconds\{.*stage="(\w+)"\}|(run)_seconds\{.*\}) (\S+)$', line.strip())
            if m:
                out[m.group(1) or m.group(2)] = float(m.group(3))
    return out


def native_dtypes(names: list[str]) -> tuple[list[torch.dtype], list[str]]:
    """Of these dtype names, the dtypes oneDNN runs natively on this CPU, and the names of the others."""
    from elmo_pipeline.model import onednn
    dtypes = [getattr(torch, d) for d in names]
    native = [d for d in dtypes if onednn.runs(torch.device("cpu"), d)]
    return native, [str(d).removeprefix("torch.") for d in dtypes if d not in native]


def cpu_report(tool: str, argv: list[str] | None, shape: str, threads: int, runs: list, not_native: list[str]) -> dict:
    """A CPU benchmark's report: the machine, the command that made it, its shape, threads and runs, the dtypes
    skipped as not native."""
    return {"machine": machine(), "command": f"python -m benchmarks.{tool} " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
            "shape": shape, "threads": threads, "runs": runs, "not_native": not_native}


def write_cpu_report(report: dict, out: str | None, tool: str) -> dict:
    """cpu_report's dtypes not measured printed, then the report written (write_result); returns it."""
    for d in report["not_native"]:
        print(f"{d}: oneDNN does not run it natively here: not measured")
    write_result(report, out, tool)
    return report
