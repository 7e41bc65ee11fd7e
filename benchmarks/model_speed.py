"""Model-only throughput: tokens/s of the biLM on real sentences, against a GEMM ceiling measured
in the same run. Random weights of the published shapes (model/synthetic.py).

    .venv/bin/python -m benchmarks.model_speed --configs small medium original --threads 2 \
        --max-tokens 4096 16384 --sentences 2000 [--path forward embedder] [--device cpu|cuda] [--dtype float32 bfloat16] [--lstm-gemm auto bmm]

Two paths: `forward` times BiLM.forward on prepared char-id batches; `embedder` times what a user
calls, ElmoEmbedder.embed_sentences(max_tokens=budget) (char ids, batching, numpy results included),
with the cross-batch token cache first filled from other text (WikiText-2 train, distinct tokens of
--warm-cache-sentences sentences), as in a long job's steady state.

--batch-invariant off|on|both: the fast path (default, as the embedder's), the batch-invariant path
(bit-identical vectors whatever the batching, model/bilm.py), or both side by side; with --repeats N each (config, budget, path) is measured N times, the two modes interleaved, and
the median is reported (the cost of the batch-invariant path: benchmarks/README.md).

Shares of the ceiling: "done", the headline, counts the char CNN only for the rows it actually encoded (the token
cache skips most tokens on the embedder path), so it is the share of the ceiling the machine's work used; "counted"
counts flops_per_token for every token (the char CNN included); "LSTM alone" counts only the LSTMs' FLOPs. The
embedder path also says what bounds it (Breakdown): the LSTM loops' share of the wall time and of the ceiling over
their own time, rows a step, the token encoder's and the rest's time, and the <S>/</S> rows the LSTMs compute but
"done" does not count.

With --dtype bfloat16/float16 it first measures, per output layer, the relative error of that dtype
against float32 (same weights, first 200 sentences). Prints a table and writes
benchmarks/results/model_speed_<device>_<dtype>_<threads>t.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import time

import torch

from benchmarks.common import (RESULTS, flops_per_token, gemm_ceiling_gflops, gemm_rates_gflops,
                               lstm_flops_per_token, machine, wikitext_sentences)
from elmo_pipeline.model.batching import plan_batches
from elmo_pipeline.model.char_ids import batch_char_ids
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.model.lstm import LSTM_LOOPS, LstmProjection, step_loop
from elmo_pipeline.model.options import parse_options
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS, random_bilm


class EncodedRows:
    """Counts the rows the token encoder (char CNN, highway, projection) computes while active: with the token
    cache most tokens skip it, so the FLOPs done are the LSTM's for every token plus the encoder's for these."""

    def __init__(self, model):
        self.model, self.rows = model, 0

    def __enter__(self):
        self.hook = self.model.token_encoder.register_forward_hook(lambda m, a, out: self._add(out.shape[0]))
        return self

    def _add(self, n: int) -> None:
        self.rows += n

    def __exit__(self, *exc):
        self.hook.remove()

    def gflops_done(self, n_tokens: int, wall: float) -> float:
        o = self.model.opts
        lstm = lstm_flops_per_token(o)
        return (n_tokens * lstm + self.rows * (flops_per_token(o) - lstm)) / wall / 1e9


class Breakdown:
    """Where an embedder run's wall time goes, without a profiler: seconds in the LSTM loops (both directions of a
    layer per model.lstm.run_lstm_layers call) and in the token encoder; the LSTM rows computed (<S>/</S> and
    batch-invariant padding included) and steps (report)."""

    def __init__(self, model):
        self.model, self.lstm_s, self.encoder_s, self.lstm_rows, self.steps, self.calls = model, 0.0, 0.0, 0, 0, 0

    def __enter__(self):
        import elmo_pipeline.model.bilm as bilm
        self._bilm, self._run = bilm, bilm.run_lstm_layers

        def timed(loop, layers, weights, x, batch_sizes, h0, c0, step_rows=None, resets=None):
            t = time.perf_counter()
            out = self._run(loop, layers, weights, x, batch_sizes, h0, c0, step_rows, resets)
            self.lstm_s += time.perf_counter() - t
            self.lstm_rows += sum(step_rows or batch_sizes)
            self.steps += len(batch_sizes)
            self.calls += 1
            return out

        bilm.run_lstm_layers = timed
        enc = self.model.token_encoder
        self._hooks = [enc.register_forward_pre_hook(lambda m, a: setattr(self, "_t", time.perf_counter())),
                       enc.register_forward_hook(lambda m, a, o: self._encoded())]
        return self

    def _encoded(self) -> None:
        self.encoder_s += time.perf_counter() - self._t

    def __exit__(self, *exc):
        self._bilm.run_lstm_layers = self._run
        for h in self._hooks:
            h.remove()

    def report(self, wall: float, n_tokens: int) -> dict:
        """Seconds in the LSTM loops, the encoder and the rest; rows a step; the share of the LSTM rows that are
        <S>/</S> (or padding), computed but not counted as work done; the loops' GFLOP/s over their own time."""
        o = self.model.opts
        lstm_gflop = self.lstm_rows * lstm_flops_per_token(o) / o.n_layers / 1e9
        return {"lstm_s": self.lstm_s, "encoder_s": self.encoder_s, "other_s": wall - self.lstm_s - self.encoder_s,
                "lstm_rows_per_layer": self.lstm_rows // max(1, o.n_layers),
                "rows_per_step": self.lstm_rows / max(1, self.steps),
                "uncounted_share_of_lstm_rows": 1 - n_tokens * o.n_layers / max(1, self.lstm_rows),
                "lstm_gflops_inside": lstm_gflop / self.lstm_s if self.lstm_s else None}


HEADLINE = ("done_fraction_of_ceiling: the share of the GEMM ceiling the work done used (the char CNN counted only "
            "for the rows it encoded); fraction_of_ceiling counts it for every token")


# Ops of a torch profile by kind (self CPU time): the GEMMs, and the LSTM cell's pointwise work.
GEMM_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
            "aten::baddbmm_"}
CELL_OPS = {"aten::tanh", "aten::tanh_", "aten::sigmoid_", "aten::mul_", "aten::addcmul_", "aten::clamp_", "aten::mul",
            "aten::exp_", "aten::add_", "aten::reciprocal_", "aten::addcmul"}


MAIN_THREAD_MARK = "model_speed.main_thread"


def profile_shares(prof, threads: int) -> dict:
    """Seconds of a torch profile, weighted by the intra-op threads each op had (`threads` in the caller's thread,
    threads // 2 in the oneDNN loop's direction helpers, model/direction_threads.py), so that a rate computed over
    them compares with the ceiling at `threads` threads: total, in GEMM_OPS and in CELL_OPS; and the oneDNN linears
    (the LSTM step's and the encoder's) by rows per call, m in [2^k, 2^(k+1)): calls, seconds and GFLOP/s inside
    the calls. The caller's thread is the one that recorded MAIN_THREAD_MARK."""
    events = list(prof.events())
    main = next((e.thread for e in events if e.name == MAIN_THREAD_MARK), None)
    helper = max(1, threads // 2)
    by_op: dict[str, float] = {}
    by_rows: dict[int, list] = {}
    for e in events:
        weight = (threads if e.thread == main else helper) / threads        # thread-seconds / threads
        seconds = e.self_cpu_time_total / 1e6 * weight
        by_op[e.name] = by_op.get(e.name, 0.0) + seconds
        shapes = e.input_shapes if e.name == "mkldnn::_linear_pointwise" else None
        if shapes and len(shapes[0]) == 2 and len(shapes[1]) == 2 and shapes[0][0]:
            (m, k), n = shapes[0], shapes[1][0]
            row = by_rows.setdefault(1 << (m.bit_length() - 1), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += seconds
            row[2] += 2 * m * k * n
    return {"total_s": sum(by_op.values()), "gemm_s": sum(v for k, v in by_op.items() if k in GEMM_OPS),
            "cell_s": sum(v for k, v in by_op.items() if k in CELL_OPS),
            "linear_by_rows": [{"rows": f"{lo}-{2 * lo - 1}", "calls": c, "seconds": t, "gflops": f / t / 1e9}
                               for lo, (c, t, f) in sorted(by_rows.items()) if t > 0]}


def measure_embedder(config: str, sentences, max_tokens: int, device: str, dtype: torch.dtype,
                     warm_sentences: list[list[str]], barrier=None, batch_invariant: bool = False,
                     lanes: bool = True, profile: bool = False) -> dict:
    model = random_bilm(config).to(device=device, dtype=dtype)
    embedder = ElmoEmbedder(model=model, device=device, batch_invariant=batch_invariant, lanes=lanes)
    seen: dict[str, None] = {}
    for s in warm_sentences:
        seen.update(dict.fromkeys(s))
    words = list(seen)[:50_000]
    with torch.inference_mode():
        for i in range(0, len(words), 4096):    # fill the token cache (first-seen order, as a job would)
            ids, _ = batch_char_ids([words[i: i + 4096]])
            model.encode_tokens(torch.from_numpy(ids[0]).to(device), batch_invariant)
    list(embedder.embed_sentences(sentences[:50], max_tokens=max_tokens))          # warm-up
    if device != "cpu":
        torch.cuda.synchronize()
    if barrier is not None:             # several processes: all start timing together
        barrier.wait()
    t, cpu = time.perf_counter(), time.process_time()
    n_batches = len(plan_batches([len(s) for s in sentences], max_tokens, lanes=embedder.lanes))
    # every thread's ops: the oneDNN loop runs the directions in helper threads (model/direction_threads.py)
    all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                  experimental_config=all_threads) if profile else contextlib.nullcontext()
    with EncodedRows(model) as encoded, Breakdown(model) as breakdown, prof:
        with torch.profiler.record_function(MAIN_THREAD_MARK):
            pass
        for _ in embedder.embed_sentences(sentences, max_tokens=max_tokens):
            pass
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    n_tokens = sum(len(s) for s in sentences)
    fpt = flops_per_token(model.opts)
    extra = {"breakdown": breakdown.report(wall, n_tokens)} if device == "cpu" else {}   # (a GPU's time is async)
    if profile:
        extra["profile"] = p = profile_shares(prof, torch.get_num_threads())
        p["gemm_gflops_inside"] = encoded.gflops_done(n_tokens, p["gemm_s"])    # the FLOPs done / the GEMMs' time
    return {**extra, "config": config, "path": "embedder", "tokens": n_tokens, "sentences": len(sentences),
            "batches": n_batches, "cache_words": len(words), "wall_s": wall, "tokens_per_s": n_tokens / wall,
            "cpu_s": cpu, "tokens_per_cpu_s": n_tokens / cpu, "encoder_rows": encoded.rows,
            "flops_per_token": fpt, "gflops": n_tokens / wall * fpt / 1e9,
            "gflops_done": encoded.gflops_done(n_tokens, wall)}


def measure(config: str, sentences, max_tokens: int, device: str, dtype: torch.dtype,
            batch_invariant: bool = False) -> dict:
    model = random_bilm(config).to(device=device, dtype=dtype)
    batches = plan_batches([len(s) for s in sentences], max_tokens)
    inputs = []
    for idx in batches:
        ids, lengths = batch_char_ids([sentences[i] for i in idx])
        inputs.append((torch.from_numpy(ids).to(device), torch.from_numpy(lengths)))
    n_tokens = sum(len(s) for s in sentences)
    with torch.inference_mode():
        model(*inputs[0], batch_invariant=batch_invariant)  # warm-up
        if device != "cpu":
            torch.cuda.synchronize()
        t, cpu = time.perf_counter(), time.process_time()
        with EncodedRows(model) as encoded:
            for ids, lengths in inputs:
                out, _ = model(ids, lengths, batch_invariant=batch_invariant)
                out = out.float().cpu()                         # results back on the host, as a user needs them
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    fpt = flops_per_token(model.opts)
    return {"config": config, "path": "forward", "tokens": n_tokens, "sentences": len(sentences), "batches": len(batches),
            "wall_s": wall, "tokens_per_s": n_tokens / wall, "cpu_s": cpu, "tokens_per_cpu_s": n_tokens / cpu,
            "flops_per_token": fpt, "encoder_rows": encoded.rows,
            "gflops": n_tokens / wall * fpt / 1e9, "gflops_done": encoded.gflops_done(n_tokens, wall)}


def layer_relative_errors(config: str, sentences, max_tokens: int, device: str, dtype: torch.dtype) -> list[float]:
    """Per output layer, ||y_dtype - y_fp32|| / ||y_fp32|| (Frobenius, real positions only) over the batches
    of `sentences`: the error of running the biLM in a lower precision, the same random weights."""
    ref = random_bilm(config).to(device=device)
    low = random_bilm(config).to(device=device, dtype=dtype)
    num = den = None
    with torch.inference_mode():
        for idx in plan_batches([len(s) for s in sentences], max_tokens):
            ids, lengths = batch_char_ids([sentences[i] for i in idx])
            ids, lengths = torch.from_numpy(ids).to(device), torch.from_numpy(lengths)
            a = ref(ids, lengths)[0].double()
            b = low(ids, lengths)[0].double()
            d, r = ((b - a) ** 2).sum(dim=(1, 2, 3)), (a ** 2).sum(dim=(1, 2, 3))   # zeros at padding
            num, den = (d, r) if num is None else (num + d, den + r)
    return (num.sqrt() / den.sqrt()).tolist()


def _process_worker(args: tuple, barrier, results) -> None:
    config, sentences, budget, threads, warm, invariant = args
    torch.set_num_threads(threads)
    results.put(measure_embedder(config, sentences, budget, "cpu", torch.float32, warm, barrier, invariant))


def measure_processes(config: str, sentences, max_tokens: int, threads: int, processes: int, warm,
                      batch_invariant: bool = False) -> dict:
    """The embedder path in `processes` worker processes at once (as Beam runs one SDK worker per core),
    each on every processes-th sentence: total tokens / the slowest process's wall time."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=((config, sentences[i::processes], max_tokens, threads, warm,
                                                        batch_invariant),
                                                       barrier, results)) for i in range(processes)]
    for pr in procs:
        pr.start()
    rows = [results.get() for _ in procs]
    for pr in procs:
        pr.join()
    n_tokens, wall = sum(r["tokens"] for r in rows), max(r["wall_s"] for r in rows)
    fpt = rows[0]["flops_per_token"]
    return {"config": config, "path": f"embedder x{processes} processes", "tokens": n_tokens,
            "sentences": len(sentences), "batches": sum(r["batches"] for r in rows), "wall_s": wall,
            "tokens_per_s": n_tokens / wall, "flops_per_token": fpt, "gflops": n_tokens / wall * fpt / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["small", "medium", "original"])
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                    help="one or more: several are measured side by side (interleaved)")
    ap.add_argument("--lstm-gemm", nargs="+", default=["auto"], choices=list(LSTM_LOOPS),
                    help="the LSTM loop (BiLM.lstm_loop, model/lstm.py LSTM_LOOPS); several are measured side by side")
    ap.add_argument("--path", nargs="+", default=["forward", "embedder"], choices=["forward", "embedder"])
    ap.add_argument("--warm-cache-sentences", type=int, default=5000)
    ap.add_argument("--batch-invariant", choices=["off", "on", "both"], default="off",
                    help="the fast path (default, as the embedder's), the batch-invariant path, or both")
    ap.add_argument("--lanes", nargs="+", choices=["on", "off"], default=["on"],
                    help="embedder path: sentences laid end to end in the LSTMs' lanes (ElmoEmbedder lanes=); "
                    "several are measured side by side")
    ap.add_argument("--profile", action="store_true",
                    help="embedder path: run under torch's profiler (slower: compare its rows only with each other) and "
                    "report the GEMMs' and the LSTM cell's share of the CPU time, the GEMMs' GFLOP/s inside the calls, "
                    "and the oneDNN linears' GFLOP/s by rows per call")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per row (variants interleaved); median kept")
    ap.add_argument("--tag", default="", help="appended to the results file name")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/model_speed_<device>_<dtypes>_"
                    "<threads>t[_TAG].json; kept results are named model_speed_<machine kind>[_variant].json)")
    ap.add_argument("--processes", type=int, default=1,
                    help="CPU: also run the embedder path in this many processes of --threads threads each, "
                    "against the GEMM ceiling of processes x threads threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sentences = wikitext_sentences(args.sentences)
    rates = {d: gemm_rates_gflops(args.threads, dtype=getattr(torch, d), device=args.device) for d in args.dtype}
    for d, r in rates.items():
        print(f"GEMM ceiling {d}, {args.threads} thread(s): "
              + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) + " GFLOP/s (square 2048)", flush=True)
    ceiling = {d: max(r.values()) for d, r in rates.items()}
    warm = wikitext_sentences(args.warm_cache_sentences, split="train") \
        if "embedder" in args.path or args.processes > 1 else []
    paths = list(args.path)
    if args.processes > 1:
        paths.append("processes")
        whole = {d: gemm_ceiling_gflops(args.threads * args.processes, dtype=getattr(torch, d), device=args.device)
                 for d in args.dtype}
        torch.set_num_threads(args.threads)
    rows = []
    errors = {}
    for d in args.dtype:
        if d == "float32":
            continue
        for config in args.configs:     # the price of the lower precision, per layer, on the same sentences
            errors[(config, d)] = layer_relative_errors(config, sentences[:200], args.max_tokens[0], args.device,
                                                        getattr(torch, d))
            print(f"{config:<9} {d} vs float32, relative error per layer: "
                  + " ".join(f"{e:.2e}" for e in errors[(config, d)]), flush=True)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.batch_invariant]
    variants = [(d, g, inv, ln) for d in args.dtype for g in args.lstm_gemm for ln in args.lanes for inv in modes]
    for config in args.configs:
        o = parse_options(PUBLISHED_OPTIONS[config])
        layer = LstmProjection(o.projection_dim, o.lstm_dim, o.projection_dim, None, None)    # its shape picks the loop
        for budget, path in ((b, p) for b in args.max_tokens for p in paths):
            runs: dict[tuple, list[dict]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                for v in variants:      # interleaved: every variant sees the same machine load
                    d, gemm, inv, lanes = v
                    dtype = getattr(torch, d)
                    os.environ["ELMO_LSTM_GEMM"] = gemm      # the models built below, here and in spawned processes
                    if path == "forward":
                        r = measure(config, sentences, budget, args.device, dtype, inv)
                    elif path == "embedder":
                        r = measure_embedder(config, sentences, budget, args.device, dtype, warm, batch_invariant=inv,
                                             lanes=lanes == "on", profile=args.profile)
                    else:
                        r = measure_processes(config, sentences, budget, args.threads, args.processes, warm, inv)
                    r["lstm_gemm_used"] = step_loop(torch.device(args.device), dtype, gemm, compile_cell=False,
                                                    layer=layer).name
                    runs[v].append(r)
            medians = {}
            for v in variants:
                d, gemm, inv, lanes = v
                top = whole[d] if path == "processes" else ceiling[d]
                tps = sorted(x["tokens_per_s"] for x in runs[v])
                r = dict(sorted(runs[v], key=lambda x: x["tokens_per_s"])[len(tps) // 2])    # the median run
                medians[v] = r["tokens_per_s"]
                r.update(max_tokens=budget, threads=args.threads, device=args.device, dtype=d, lstm_gemm=gemm,
                         processes=args.processes if path == "processes" else 1, batch_invariant=inv,
                         lanes=lanes if path == "embedder" else None,
                         repeats=args.repeats, tokens_per_s_all=[x["tokens_per_s"] for x in runs[v]],
                         gemm_ceiling_gflops=top, gemm_rates_gflops=rates[d], fraction_of_ceiling=r["gflops"] / top,
                         lstm_gflops=r["tokens_per_s"] * lstm_flops_per_token(parse_options(PUBLISHED_OPTIONS[config])) / 1e9)
                r["lstm_fraction_of_ceiling"] = r["lstm_gflops"] / top
                if "gflops_done" in r:
                    r["done_fraction_of_ceiling"] = r["gflops_done"] / top
                if r.get("breakdown", {}).get("lstm_gflops_inside"):
                    r["breakdown"]["lstm_fraction_of_ceiling_inside"] = r["breakdown"]["lstm_gflops_inside"] / top
                if (config, d) in errors:
                    r["relative_error_vs_float32_per_layer"] = errors[(config, d)]
                cpus = sorted(x.get("tokens_per_cpu_s", 0.0) for x in runs[v])
                r["tokens_per_cpu_s_median"] = cpus[len(cpus) // 2]
                r["tokens_per_cpu_s_all"] = [x.get("tokens_per_cpu_s") for x in runs[v]]
                r["tokens_per_s_median"] = tps[len(tps) // 2]
                extra = ""
                if inv and (d, gemm, False, lanes) in runs:      # medians of each mode, wall and CPU time
                    fast = runs[(d, gemm, False, lanes)]
                    base = sorted(x["tokens_per_s"] for x in fast)[len(tps) // 2]
                    base_cpu = sorted(x.get("tokens_per_cpu_s", 0.0) for x in fast)[len(tps) // 2]
                    r["tokens_per_s_vs_fast_path"] = r["tokens_per_s_median"] / base - 1
                    extra = f"  vs fast path: {100 * r['tokens_per_s_vs_fast_path']:+5.1f}% wall"
                    if base_cpu:           # (the processes path has no CPU time)
                        r["tokens_per_cpu_s_vs_fast_path"] = r["tokens_per_cpu_s_median"] / base_cpu - 1
                        extra += f", {100 * r['tokens_per_cpu_s_vs_fast_path']:+5.1f}% CPU time"
                first = variants[0]
                if v != first and first[2] == inv:
                    r["tokens_per_s_vs_first_variant"] = r["tokens_per_s_median"] / medians[first]
                    extra += f"  {r['tokens_per_s_vs_first_variant']:.2f}x {first[0]}/{first[1]}" + \
                        (f"/lanes {first[3]}" if len(args.lanes) > 1 else "")
                rows.append(r)
                print(f"{config:<9} {r['path']:<22} {d:<8} {gemm + '=' + r['lstm_gemm_used']:<12} "
                      + (f"lanes {lanes:<3} " if len(args.lanes) > 1 else "") +
                      f"{'invariant' if inv else 'fast':<9} budget {budget:>6}  "
                      f"{r['tokens_per_s']:>9.0f} tokens/s ({r['tokens_per_cpu_s_median']:.0f}/CPU s)  "
                      + (f"done {100 * r['done_fraction_of_ceiling']:5.1f}% of GEMM {top:.0f} (counted "
                         f"{100 * r['fraction_of_ceiling']:.1f}%, " if "gflops_done" in r else
                         f"{100 * r['fraction_of_ceiling']:5.1f}% of GEMM {top:.0f} counted (")
                      + f"LSTM alone {100 * r['lstm_fraction_of_ceiling']:.1f}%){extra}", flush=True)
                if r.get("breakdown", {}).get("lstm_gflops_inside"):
                    b, wall = r["breakdown"], r["wall_s"]
                    print(f"{'':<9} bounds: LSTM loops {100 * b['lstm_s'] / wall:.0f}% of the wall time at "
                          f"{100 * b['lstm_fraction_of_ceiling_inside']:.1f}% of the ceiling inside, "
                          f"{b['rows_per_step']:.1f} rows a step; token encoder {100 * b['encoder_s'] / wall:.0f}%, "
                          f"the rest {100 * b['other_s'] / wall:.0f}%; <S>/</S> rows "
                          f"{100 * b['uncounted_share_of_lstm_rows']:.1f}% of the LSTM's (computed, not counted)",
                          flush=True)
                if "profile" in r:
                    p = r["profile"]
                    print(f"{'':<9} profiled: GEMMs {100 * p['gemm_s'] / p['total_s']:.1f}% of CPU time at "
                          f"{p['gemm_gflops_inside']:.0f} GFLOP/s inside the calls "
                          f"({100 * p['gemm_gflops_inside'] / top:.1f}% of {top:.0f}), LSTM cell pointwise "
                          f"{100 * p['cell_s'] / p['total_s']:.1f}%", flush=True)
                    for b in p["linear_by_rows"]:
                        print(f"{'':<9}   oneDNN linears of {b['rows']:>9} rows: {b['calls']:>5} calls, "
                              f"{b['seconds']:6.2f} s, {b['gflops']:4.0f} GFLOP/s ({100 * b['gflops'] / top:.1f}%)",
                              flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = f"model_speed_{args.device.split(':')[0]}_{'_'.join(args.dtype)}_{args.threads}t" + \
        (f"_x{args.processes}p" if args.processes > 1 else "") + \
        (f"_invariant_{args.batch_invariant}" if args.batch_invariant != "off" else "") + \
        (f"_{args.tag}" if args.tag else "") + ".json"
    with open(args.out or os.path.join(RESULTS, name), "w") as f:
        json.dump({"machine": machine(), "command": "python -m benchmarks.model_speed " + " ".join(
            __import__("sys").argv[1:]), "headline": HEADLINE, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
