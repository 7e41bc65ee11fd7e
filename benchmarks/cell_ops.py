"""What the LSTM cell's pointwise work costs a step, op by op, beside the step's GEMMs.

    python -m benchmarks.cell_ops [--shape original] [--rows 42 183] [--threads 1] [--dtypes float32 bfloat16]
        [--out F]

The oneDNN loop's cell (model/lstm_loops.py _onednn_direction) on `--rows` rows of a published shape at `--threads`
torch threads (1: what each direction gets on a 2-core machine): its ops one at a time (c * f, + i * j, the cell
clip, o * tanh(c) as _tanh_times computes it) and the whole cell, beside torch's own tanh in the dtype then the
product with o (the route _tanh_times takes instead), and the step's three GEMMs as the loop calls them (weights
prepacked; the gates' activations fused) and again without their activations ("none"): the difference is the
pointwise work done inside the GEMM calls. Microseconds a step and direction, each the median of 5 timings of at
least 0.1 s, each op on fresh inputs (the copy that restores them timed alone and taken off); the GEMMs' GFLOP/s
beside the square-GEMM ceiling at `--threads` measured in the same run (benchmarks.common.gemm_ceiling_gflops), and
the step's share of it: as the loop runs it, and were all its pointwise work free (the GEMMs without activations
alone). Prints a table; the JSON (default results/cell_ops_<kind>.json) names the machine. bfloat16 only where oneDNN
runs it natively.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import cpu_report, gemm_ceiling_gflops, machine, native_dtypes, write_cpu_report


def median_us(call, seconds: float = 0.1, timings: int = 5) -> float:
    """Median over `timings` of the mean microseconds of call() repeated for at least `seconds` (after 2 warm-ups)."""
    call()
    call()
    out = []
    for _ in range(timings):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
            call()
            n += 1
        out.append(elapsed / n * 1e6)
    return sorted(out)[timings // 2]


def measure(shape: str, dtype: torch.dtype, rows: int, threads: int, ceiling: float) -> dict:
    """One step and direction of the oneDNN loop at `rows` rows: the cell's ops, the whole cell, torch's tanh
    route, and the three step GEMMs with and without their fused activations, in microseconds; the step's share
    of `ceiling` (GFLOP/s) as it runs and were its pointwise work free."""
    from elmo_pipeline.model import onednn
    from elmo_pipeline.model.kernels import shape_layers
    from elmo_pipeline.model.lstm_loops import _tanh_times, onednn_step_gemms
    from elmo_pipeline.model.options import parse_options
    from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
    layer = shape_layers(parse_options(PUBLISHED_OPTIONS[shape]))[0]
    H, clip = layer.dim, layer.cell_clip
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=g) * (hi - lo) + lo).to(dtype)
    with torch.inference_mode():
        sig, j, c0 = rand(rows, 3 * H, lo=0.0), rand(rows, H), rand(rows, H, lo=-3.0, hi=3.0)
        i, f, o = sig.split(H, dim=1)
        c, out, tmp = torch.empty_like(c0), torch.empty_like(c0), torch.empty(rows, H)

        def reset():
            c.copy_(c0)

        def cell():
            reset()
            cg = c.mul_(f).addcmul_(i, j)
            if clip is not None:
                cg.clamp_(-clip, clip)
            _tanh_times(cg, o, out, tmp)
        ops = {"c * f": lambda: (reset(), c.mul_(f)),
               "+ i * j": lambda: (reset(), c.addcmul_(i, j)),
               "cell clip": lambda: (reset(), c.clamp_(-(clip or 3.0), clip or 3.0)),
               "o * tanh(c) (_tanh_times)": lambda: (reset(), _tanh_times(c, o, out, tmp)),
               "o * tanh(c) (torch.tanh in the dtype)": lambda: (reset(), torch.tanh(c, out=out).mul_(o)),
               "the whole cell": cell}
        restore = median_us(reset)
        cell_us = {name: median_us(call) - restore for name, call in ops.items()}
        gemm_us, bare_us, flops = {}, {}, 0
        for name, k, n, attr, scalars, bias in onednn_step_gemms(layer):
            w = onednn.pack((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype))
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            x = torch.randn(rows, k, generator=g).to(dtype)
            gemm_us[name] = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, attr, scalars, ""))
            bare_us[name] = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))
            flops += 2 * rows * k * n
    gemms, bare, cell = sum(gemm_us.values()), sum(bare_us.values()), cell_us["the whole cell"]
    fused = gemms - bare                  # the activations oneDNN applies inside the GEMM calls
    step = cell + gemms
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "elements": rows * H, "restore_us": restore,
            "cell_us": cell_us, "gemm_us": gemm_us, "gemm_without_activation_us": bare_us,
            "gemm_gflops": flops / gemms / 1e3, "gemm_without_activation_gflops": flops / bare / 1e3,
            "ceiling_gflops": ceiling, "cell_share_of_step": cell / step,
            "pointwise_share_of_step": (cell + fused) / step,
            "step_fraction_of_ceiling": flops / step / 1e3 / ceiling,
            "pointwise_free_fraction_of_ceiling": flops / bare / 1e3 / ceiling}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cell_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="original", choices=["small", "medium", "original"])
    ap.add_argument("--rows", type=int, nargs="+", default=[42, 183])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtypes, skipped = native_dtypes(args.dtypes)
    ceilings = {d: gemm_ceiling_gflops(args.threads, dtype=d) for d in dtypes}
    runs = [measure(args.shape, d, m, args.threads, ceilings[d]) for d in dtypes for m in args.rows]
    report = cpu_report("cell_ops", argv, args.shape, args.threads, runs, skipped)
    print(f"{machine()}; {args.shape} shape, one step and direction, {args.threads} torch thread(s), microseconds")
    for r in runs:
        print(f"{r['dtype']} at {r['rows']} rows ({r['elements']:,} cell elements): the cell "
              f"{100 * r['cell_share_of_step']:.1f} % of the step, all its pointwise work (the GEMMs' fused "
              f"activations too) {100 * r['pointwise_share_of_step']:.1f} %; the step at "
              f"{100 * r['step_fraction_of_ceiling']:.1f} % of the {r['ceiling_gflops']:.0f} GFLOP/s ceiling, "
              f"{100 * r['pointwise_free_fraction_of_ceiling']:.1f} % were its pointwise work free")
        for name, us in [*r["cell_us"].items(), *(("GEMM " + k, v) for k, v in r["gemm_us"].items()),
                         *(("GEMM " + k + " without activation", v) for k, v in r["gemm_without_activation_us"].items())]:
            print(f"  {name:<40}{us:>10.1f}")
    return write_cpu_report(report, args.out, "cell_ops")


if __name__ == "__main__":
    main()
