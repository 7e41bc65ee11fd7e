"""Which oneDNN kernel runs each LSTM step GEMM here, does it reorder anything per call, and how fast is it?

`python -m benchmarks.onednn_kernels [--shape original] [--rows 4 40 184 512] [--threads 1] [--dtypes float32 bfloat16]
[--pack-for-rows] [--pieces P ...] [--out F]`: the oneDNN loop's step GEMMs of a published shape (model/lstm_loops.py
onednn_step_gemms: the sigmoid gates, gate j, the projection), with weights prepacked as the loop packs them
(model/onednn.py pack: for oneDNN's default of 128 rows; with --pack-for-rows also for each call's row count, in case
the layout oneDNN wants depends on it), called as the loop calls them, at each row count and `--threads` torch threads (1: what each direction gets on a 2-core machine).
Per GEMM and row count: the implementation oneDNN ran and its weights' layout (from oneDNN's verbose output of one
call), the primitives besides the GEMM it executed in that call (a `reorder` there means weights or activations
converted on every call), and GFLOP/s over calls of at least 0.2 s against the dtype's square-GEMM ceiling measured in
the same run at the same threads (benchmarks.common). With --pieces, each row count is also called in row pieces of
at most P rows (as model/lstm_loops.py gate_rows cuts the gate GEMMs on a CPU with AMX), its rate over all the rows. Prints a table; the JSON (default
results/onednn_kernels_<kind>.json) names the machine. bfloat16 only where oneDNN runs it natively.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import cpu_report, gemm_ceiling_gflops, machine, native_dtypes, write_cpu_report


def verbose_lines(call) -> list[list[str]]:
    """oneDNN's verbose `exec` records of one call (fields split at commas), captured from the C-level stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                call()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    return [line.split(",") for line in text.splitlines() if ",primitive,exec," in line]


def kernel_of(records: list[list[str]]) -> dict:
    """The GEMM primitive's implementation and weights' layout, and the other primitives executed, of one call."""
    gemm = [r for r in records if r[5] in ("inner_product", "matmul")]
    others = [r[5] for r in records if r[5] not in ("inner_product", "matmul")]
    impl, weights = (gemm[-1][6], next((d.split(":", 1)[1] for d in gemm[-1][8].split() if d.startswith("wei:")),
                                      None)) if gemm else (None, None)
    return {"implementation": impl, "weights": weights, "other_primitives": others}


def gflops(call, flops: float, seconds: float = 0.2) -> float:
    """GFLOP/s of call (flops each) over repeated calls lasting at least `seconds`, after two warm-up calls."""
    call()
    call()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
        call()
        n += 1
    return flops * n / elapsed / 1e9


def measure(shape: str, dtype: torch.dtype, rows: list[int], threads: int, pack_for_rows: bool = False,
            pieces: tuple[int, ...] = ()) -> dict:
    """The step GEMMs of `shape` in `dtype` at each row count: weights packed as the loop packs them (packed_for
    None: oneDNN's default batch of 128 rows) and, with pack_for_rows, also packed for the call's row count."""
    from elmo_pipeline.model import onednn
    from elmo_pipeline.model.kernels import shape_layers
    from elmo_pipeline.model.lstm_loops import onednn_step_gemms
    from elmo_pipeline.model.options import parse_options
    from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
    layer = shape_layers(parse_options(PUBLISHED_OPTIONS[shape]))[0]
    ceiling = gemm_ceiling_gflops(threads, dtype=dtype)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        for name, k, n, attr, scalars, bias in onednn_step_gemms(layer):
            plain = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            w = onednn.pack(plain)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dtype)
                for packed_for in (None, m) if pack_for_rows else (None,):
                    weights = w if packed_for is None else torch.ops.mkldnn._reorder_linear_weight(plain, m)

                    def call():
                        return torch.ops.mkldnn._linear_pointwise(x, weights, b, attr, scalars, "")
                    call()                                                 # the primitive made and cached
                    rate = gflops(call, 2.0 * m * k * n)
                    out.append({"gemm": name, "k": k, "n": n, "rows": m, "packed_for": packed_for, "pieces": None,
                                **kernel_of(verbose_lines(call)), "gflops": rate, "share_of_ceiling": rate / ceiling})
                for p in (p for p in pieces if p < m):
                    def pieces_call(p=p):
                        return [torch.ops.mkldnn._linear_pointwise(x[a: a + p], w, b, attr, scalars, "")
                                for a in range(0, m, p)]
                    pieces_call()
                    rate = gflops(pieces_call, 2.0 * m * k * n)
                    out.append({"gemm": name, "k": k, "n": n, "rows": m, "packed_for": None, "pieces": p,
                                **kernel_of(verbose_lines(pieces_call)), "gflops": rate, "share_of_ceiling": rate / ceiling})
    return {"dtype": str(dtype).removeprefix("torch."), "ceiling_gflops": ceiling, "gemms": out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="original", choices=["small", "medium", "original"])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 40, 184, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--pack-for-rows", action="store_true",
                    help="also call each GEMM with its weights packed for the call's row count (oneDNN's weights "
                    "layout may depend on it; the loop packs for oneDNN's default of 128 rows)")
    ap.add_argument("--pieces", type=int, nargs="*", default=[],
                    help="also call each row count in pieces of at most P rows (model/lstm_loops.py gate_rows)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtypes, skipped = native_dtypes(args.dtypes)
    runs = [measure(args.shape, d, args.rows, args.threads, args.pack_for_rows, tuple(args.pieces)) for d in dtypes]
    report = cpu_report("onednn_kernels", argv, args.shape, args.threads, runs, skipped)
    print(f"{machine()}; {args.shape} shape's step GEMMs, {args.threads} torch thread(s)")
    print(f"{'dtype':<9}{'gemm':<11}{'K x N':>12}{'rows':>6}{'pieces':>7}{'packed for':>11}  {'implementation':<30}{'weights':<30}"
          f"{'per call':<12}{'GFLOP/s':>9}{'share':>8}")
    for r in runs:
        for x in r["gemms"]:
            print(f"{r['dtype']:<9}{x['gemm']:<11}{x['k']:>6}x{x['n']:<5}{x['rows']:>6}{x['pieces'] or '-':>7}{x['packed_for'] or 128:>11}  "
                  f"{x['implementation'] or '?':<30}"
                  f"{x['weights'] or '?':<30}{','.join(x['other_primitives']) or '-':<12}{x['gflops']:>9.1f}"
                  f"{100 * x['share_of_ceiling']:>7.1f}%")
        print(f"{r['dtype']:<9}ceiling {r['ceiling_gflops']:.1f} GFLOP/s (square 2048 GEMM, same threads)")
    return write_cpu_report(report, args.out, "onednn_kernels")


if __name__ == "__main__":
    main()
