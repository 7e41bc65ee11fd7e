"""Shared pieces of the benchmarks: real sentences, FLOP counts, a GEMM ceiling."""
from __future__ import annotations

import os
import platform
import time

import torch

from model.options import BiLMOptions

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared")
RESULTS = os.path.join(HERE, "results")


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
    """Measured square-GEMM GFLOP/s on this device with `threads` threads (best of the runs)."""
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def cpu_name() -> str:
    """The CPU's model name and family (model.hardware.cpu_info: 'AMD EPYC' names both this project's AMD
    kinds, family 23 = Zen 1, 26 = Zen 5), with AVX-512 or its absence noted: GEMM speeds depend on all."""
    from model.hardware import cpu_info
    cpu = cpu_info()
    if cpu["flags"] is None:
        return platform.processor() or platform.machine()
    family = f" (family {cpu['family']})" if cpu["family"] is not None else ""
    return (cpu["name"] or "") + family + (", AVX-512" if "avx512f" in cpu["flags"] else ", no AVX-512")


def machine() -> str:
    return f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"
