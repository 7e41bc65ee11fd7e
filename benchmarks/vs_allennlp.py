"""Side by side with AllenNLP's ELMo (../shared/tools/allennlp-reference) on the same weights and sentences.

For each config: random weights of the published shapes, the same WikiText-2 sentences, the same
thread count; AllenNLP's `elmo --all` driver, then ours (`elmo-pipeline elmo --all`, stateful with the
same consecutive batches; stateless, our default, which length-sorts; and stateless with batches cut by a
token budget, --max-tokens-per-batch, which the CPU runs fastest). Reports tokens/s, the
ratio pair by pair, and the max |diff| of our stateful output from AllenNLP's (all layers). Both sides
are timed over the same span: reading the input, embedding and writing the HDF5 file, after the model
load (AllenNLP's driver prints its figure; ours is the `elmo` command's own closing line); and the whole
process's wall time of each command (Python start, imports and model load included), what a user waits for.

    bash ../shared/tools/allennlp-reference/setup.sh ../.venv-allennlp-ref      # once
    .venv/bin/python -m benchmarks.vs_allennlp --configs small medium original --sentences 2000 --threads 2 [--bf16]
With --bf16 ours also runs with --compute-dtype bfloat16 (stateless, and with the budget) against AllenNLP's float32,
and bf16's relative error per output layer against ours in float32 is recorded beside it.
Writes benchmarks/results/vs_allennlp_<threads>t.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

from benchmarks.common import RESULTS, SHARED, machine, wikitext_sentences
from elmo_pipeline.model.synthetic import write_random_bilm

TOOL = os.path.join(SHARED, "tools", "allennlp-reference", "allennlp_embed.py")


def run_allennlp(venv: str, options: str, weights: str, inp: str, out: str, batch: int, threads: int
                 ) -> tuple[float, float]:
    """AllenNLP's tokens/s after its model load (its driver's figure) and the whole process's wall seconds."""
    t = time.perf_counter()
    r = subprocess.run([os.path.join(venv, "bin", "python"), TOOL, "--options", options, "--weights", weights,
                        "--input", inp, "--batch-size", str(batch), "--threads", str(threads), "--out", out],
                       capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    return float(re.search(r"tokens_per_s=([\d.]+)", r.stdout.strip().splitlines()[-1]).group(1)), wall


def run_ours(options: str, weights: str, inp: str, out: str, batch: int, threads: int, state: str,
             max_tokens: int = 0, dtype: str = "float32") -> tuple[float, float]:
    """Our `elmo` command's tokens/s after the model load (its own closing line) and the whole process's wall
    seconds (Python start, imports, model load, embedding, writing)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ELMO_THREADS": str(threads)}
    code = ("import sys, torch; torch.set_num_threads(%d); from pipeline.cli import console; "
            "console(sys.argv[1:])" % threads)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "elmo", inp, out, "--all", "--state", state, "--batch-size", str(batch),
                        "--max-tokens-per-batch", str(max_tokens), "--options-file", options, "--weight-file", weights,
                        "--compute-dtype", dtype],
                       check=True, env=env, capture_output=True, text=True)
    # the command's own figure: read, embed and write after the model load, the span AllenNLP's driver times
    wall = time.perf_counter() - t
    return float(re.search(r"\(([\d.]+) tokens/s after loading the model\)", r.stderr).group(1)), wall


def max_diff(a: str, b: str) -> float:
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        return max(float(np.abs(fa[k][...] - fb[k][...]).max(initial=0)) for k in fa if k != "sentence_to_index")


def layer_errors(ref: str, low: str) -> list[float]:
    """Per output layer ||low - ref|| / ||ref|| over every sentence of two `elmo --all` files (bf16_quality's measure)."""
    from benchmarks.bf16_quality import LayerError
    err = LayerError()
    with h5py.File(ref, "r") as fa, h5py.File(low, "r") as fb:
        for k in fa:
            if k != "sentence_to_index":
                err.add(fa[k][...], fb[k][...])
    return err.result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["small", "medium", "original"])
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16384,
                    help="token budget of our third run (stateless, --max-tokens-per-batch); 0 to skip it")
    ap.add_argument("--bf16", action="store_true",
                    help="also ours with --compute-dtype bfloat16 (stateless, and budget): against AllenNLP's float32, "
                    "with bf16's relative error per layer against ours in float32")
    ap.add_argument("--venv", default=os.path.join(SHARED, "..", ".venv-allennlp-ref"))
    ap.add_argument("--tag", default="", help="appended to the results file name")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vs_allennlp_<threads>t[_TAG].json; "
                    "kept results are named vs_allennlp_<machine kind>[_variant].json)")
    args = ap.parse_args()
    sentences = wikitext_sentences(args.sentences)
    n_tokens = sum(len(s) for s in sentences)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.txt")
        with open(inp, "w", encoding="utf-8") as f:
            f.write("".join(" ".join(s) + "\n" for s in sentences))
        for config in args.configs:
            options, weights = write_random_bilm(config, os.path.join(tmp, config))
            ref = os.path.join(tmp, f"{config}-allennlp.hdf5")
            a, a_wall = run_allennlp(args.venv, options, weights, inp, ref, args.batch_size, args.threads)
            row = {"config": config, "allennlp_tokens_per_s": a, "allennlp_whole_process_s": a_wall}
            for state in ("stateful", "stateless"):
                out = os.path.join(tmp, f"{config}-{state}.hdf5")
                row[f"ours_{state}_tokens_per_s"], wall = run_ours(options, weights, inp, out, args.batch_size,
                                                                   args.threads, state)
                row[f"ratio_{state}"] = row[f"ours_{state}_tokens_per_s"] / a
                row[f"ours_{state}_whole_process_s"], row[f"ratio_{state}_whole_process"] = wall, a_wall / wall
            if args.max_tokens:
                out = os.path.join(tmp, f"{config}-budget.hdf5")
                row["ours_budget_tokens_per_s"], wall = run_ours(options, weights, inp, out, args.batch_size,
                                                                 args.threads, "stateless", args.max_tokens)
                row["ratio_budget"] = row["ours_budget_tokens_per_s"] / a
                row["ours_budget_whole_process_s"], row["ratio_budget_whole_process"] = wall, a_wall / wall
                row["max_abs_diff_budget_vs_stateless"] = max_diff(out, os.path.join(tmp, f"{config}-stateless.hdf5"))
            row["max_abs_diff_stateful_vs_allennlp"] = max_diff(ref, os.path.join(tmp, f"{config}-stateful.hdf5"))
            after = []                              # bf16's lines, printed after the row's
            bf16 = [("bf16_stateless", 0)] + ([("bf16_budget", args.max_tokens)] if args.max_tokens else [])
            for variant, budget in bf16 if args.bf16 else []:
                out = os.path.join(tmp, f"{config}-{variant}.hdf5")
                rate, wall = run_ours(options, weights, inp, out, args.batch_size, args.threads, "stateless", budget,
                                      "bfloat16")
                row.update({f"ours_{variant}_tokens_per_s": rate, f"ratio_{variant}": rate / a,
                            f"ours_{variant}_whole_process_s": wall, f"ratio_{variant}_whole_process": a_wall / wall,
                            f"{variant}_relative_error_per_layer": layer_errors(
                                os.path.join(tmp, f"{config}-{variant.split('_')[1]}.hdf5"), out)})
                after.append(f"{config:<9} ours {variant} {rate:8.0f} tok/s ({rate / a:.2f}x) | whole process {wall:.1f} s "
                             f"({a_wall / wall:.2f}x) | relative error per layer vs float32 "
                             + " / ".join(f"{e:.2e}" for e in row[f"{variant}_relative_error_per_layer"]))
            rows.append(row)
            print(f"{config:<9} AllenNLP {a:8.0f} tok/s | ours stateful {row['ours_stateful_tokens_per_s']:8.0f} "
                  f"({row['ratio_stateful']:.2f}x) stateless {row['ours_stateless_tokens_per_s']:8.0f} "
                  f"({row['ratio_stateless']:.2f}x)"
                  + (f" budget {args.max_tokens} {row['ours_budget_tokens_per_s']:8.0f} ({row['ratio_budget']:.2f}x)"
                     if args.max_tokens else "")
                  + f" | whole process: AllenNLP {a_wall:.1f} s, ours stateless {row['ours_stateless_whole_process_s']:.1f} s"
                  f" ({row['ratio_stateless_whole_process']:.2f}x)"
                  + (f", budget {row['ours_budget_whole_process_s']:.1f} s ({row['ratio_budget_whole_process']:.2f}x)"
                     if args.max_tokens else "")
                  + f" | max|diff| {row['max_abs_diff_stateful_vs_allennlp']:.2g}", flush=True)
            for line in after:
                print(line, flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    default = os.path.join(RESULTS, f"vs_allennlp_{args.threads}t" + (f"_{args.tag}" if args.tag else "") + ".json")
    with open(args.out or default, "w") as f:
        json.dump({"machine": machine(), "command": "python -m benchmarks.vs_allennlp " + " ".join(sys.argv[1:]),
                   "sentences": len(sentences), "tokens": n_tokens,
                   "batch_size": args.batch_size, "threads": args.threads, "max_tokens": args.max_tokens,
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
