"""A worker's fixed cost before its first batch: the model loaded, then its first batch embedded.

`python -m benchmarks.model_load [--shapes small medium original] [--repeats 5] [--fresh 3] [--fresh-shapes original]
[--baseline REV] [--out results/model_load_X.json]`:
per published shape (random weights written once to a temporary folder, read from the page cache), side by side
in one process, alternating:
  built then loaded   BiLM(options) (its random initialisation) + load_weights_into: what load_bilm did before
  loaded              load_bilm: the BiLM built without initialising, every parameter then loaded
  first batch         ElmoEmbedder on the loaded model, one batch of 8 WikiText-2 sentences (the weights' packing
                      and warm-up a fresh worker does first are in it)
  invariant, checked  the same with batch_invariant=True in a process that has not checked the row rule yet (every
                      row count's row check, model/row_tile.py RowRule, is in it), and again once checked: the
                      difference is the row check's cost
Each load is consumed: every parameter summed (float64), and the two ways' sums must agree.

A fresh process (--fresh-shapes, default the original shape; --fresh repeats, each dtype the CPU runs natively; with
--baseline REV the same in a git worktree of REV, interleaved): what a worker or the `elmo` command pays before its
vectors, phase by phase, in processes started for it:
  python + torch      interpreter start and `import torch`
  exit                from the process's last line to its end (the interpreter's teardown; this process, as a
                      library user's would, does not freeze the collector as the command does: cli.console)
  our imports         the embedder and the weight loader
  load                load_bilm (options and weights read, checked, the BiLM built from them)
  first batch extra   the first batch of 8 WikiText-2 sentences less the second (the same batch again): the weights'
                      packing and oneDNN's first calls
  fixed cost          the process's wall time less two batches at the second batch's time
  elmo command        the whole `elmo --all` command on the same 8 sentences (what a user waits for)
  command exit        that command's process from its closing line ("wrote ...", on stderr) to its end: its
                      return, and the process's exit (cli.exit_with)
The table gives medians; the JSON (default results/model_load_<kind>.json) each repeat's, and names the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import machine, trees, wikitext_sentences, write_result

# A fresh process's phases (run with PYTHONPATH=<tree>): argv options, weights, dtype, sentences file (one per line)
FRESH = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.model.weights import load_bilm
t2 = time.perf_counter()
options, weights, dtype, path = sys.argv[1:5]
model = load_bilm(options, weights)
t3 = time.perf_counter()
embedder = ElmoEmbedder(model=model, dtype=dtype)
with open(path, encoding="utf-8") as f:
    sentences = [line.split() for line in f]
batches, sums = [], []
for _ in range(2):
    t = time.perf_counter()
    sums.append(sum(float(v.astype("float64").sum()) for v in embedder.embed_sentences(sentences, 64)))
    batches.append(time.perf_counter() - t)
print(json.dumps({"end": time.time(), "inside_s": time.perf_counter() - t0, "torch_s": t1 - t0, "imports_s": t2 - t1, "load_s": t3 - t2,
                  "batches_s": batches, "sums": sums}))
"""


def consumed(model) -> float:
    """Every parameter of the model reduced: what a loaded model is for, read once."""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def measure(shape: str, repeats: int, sentences: list[list[str]]) -> dict:
    from elmo_pipeline.model import row_tile
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.options import load_options
    from elmo_pipeline.model.synthetic import write_random_bilm
    from elmo_pipeline.model.weights import load_bilm, load_weights_into
    with tempfile.TemporaryDirectory() as tmp:
        options, weights = write_random_bilm(shape, tmp)
        load_bilm(options, weights)                         # the files in the page cache, torch's first calls made
        old, new, first, checked, unchecked = [], [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            a = consumed(load_weights_into(BiLM(load_options(options)), weights).eval())
            old.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = consumed(load_bilm(options, weights))
            new.append(time.perf_counter() - t)
            if a != b:
                raise SystemExit(f"error: {shape}: the two ways load different weights ({a} vs {b})")
            t = time.perf_counter()
            embedder = ElmoEmbedder(options, weights)
            for v in embedder.embed_sentences(sentences, max_tokens=4096):
                float(v.sum())
            first.append(time.perf_counter() - t)
            row_tile.forget_row_rules()
            for times in (checked, unchecked):
                t = time.perf_counter()
                embedder = ElmoEmbedder(options, weights, batch_invariant=True)
                for v in embedder.embed_sentences(sentences, max_tokens=4096):
                    float(v.sum())
                times.append(time.perf_counter() - t)
    return {"shape": shape, "built_then_loaded_s": old, "loaded_s": new, "load_and_first_batch_s": first,
            "invariant_first_batch_checking_s": checked, "invariant_first_batch_checked_s": unchecked}


def fresh(tree: str, options: str, weights: str, dtype: str, sentences: str, tmp: str) -> dict:
    """One fresh process's phases (FRESH) and the `elmo` command's whole wall time, both run from `tree`."""
    env = dict(os.environ, PYTHONPATH=tree)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", FRESH, options, weights, dtype, sentences], cwd=tree, env=env,
                       capture_output=True, text=True)
    wall, ended = time.perf_counter() - t, time.time()
    if p.returncode:
        raise SystemExit(f"error: a fresh process failed: {p.stderr.strip().splitlines()[-1:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    first, second = r.pop("batches_s")
    if r["sums"][0] != r["sums"][1]:
        raise SystemExit("error: the same batch gave other vectors the second time")
    out = os.path.join(tmp, "out.hdf5")
    t = time.perf_counter()
    c = subprocess.Popen([sys.executable, "-m", "elmo_pipeline", "elmo", sentences, out, "--all", "--options-file",
                          options, "--weight-file", weights, "--compute-dtype", dtype], cwd=tree, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = None
    for line in c.stderr:                       # its closing line ("wrote N sentences ...") comes as it is said
        if line.startswith("wrote "):
            said = time.perf_counter()
    if c.wait() or said is None:
        raise SystemExit(f"error: the elmo command failed (status {c.returncode})")
    command = time.perf_counter() - t
    os.remove(out)
    exit_s = ended - r["end"]
    return {"wall_s": wall, "python_and_torch_s": wall - r["inside_s"] - exit_s + r["torch_s"], "exit_s": exit_s,
            "imports_s": r["imports_s"],
            "load_s": r["load_s"], "first_batch_extra_s": first - second, "batch_s": second,
            "fixed_s": wall - 2 * second, "elmo_command_s": command,
            "command_exit_s": t + command - said, "sum": r["sums"][0]}


FRESH_COLUMNS = ("python_and_torch_s", "exit_s", "imports_s", "load_s", "first_batch_extra_s", "fixed_s", "batch_s",
                 "elmo_command_s", "command_exit_s")


def measure_fresh(shape: str, dtypes: list[str], repeats: int, baseline: str | None) -> list[dict]:
    """Per dtype and tree: FRESH's phases in `repeats` fresh processes each, the trees interleaved."""
    from elmo_pipeline.model.synthetic import write_random_bilm
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp, trees(baseline, tmp) as sides:
        options, weights = write_random_bilm(shape, tmp)
        sentences = os.path.join(tmp, "sentences.txt")
        with open(sentences, "w", encoding="utf-8") as f:
            f.write("".join(" ".join(s) + "\n" for s in wikitext_sentences(8)))
        for _ in range(repeats):
            for dtype in dtypes:
                for label, tree in sides.items():
                    r = fresh(tree, options, weights, dtype, sentences, tmp)
                    row = rows.setdefault((dtype, label), {"shape": shape, "dtype": dtype, "tree": label, "runs": []})
                    row["runs"].append(r)
    for row in rows.values():
        if len({r["sum"] for r in row["runs"]}) != 1:
            raise SystemExit(f"error: {shape} {row['dtype']}: fresh processes gave other vectors")
        row.update({k: statistics.median(r[k] for r in row["runs"]) for k in FRESH_COLUMNS})
    return list(rows.values())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["small", "medium", "original"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fresh", type=int, default=3, help="fresh processes per dtype and tree (0: none; default 3)")
    ap.add_argument("--fresh-shapes", nargs="+", default=["original"])
    ap.add_argument("--baseline", default=None, help="a revision whose fresh processes run beside this tree's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sentences = wikitext_sentences(8)
    rows = [measure(s, args.repeats, sentences) for s in args.shapes]
    from elmo_pipeline.model.onednn import runs
    dtypes = ["float32"] + (["bfloat16"] if runs(torch.device("cpu"), torch.bfloat16) else [])
    fresh_rows = [r for s in (args.fresh_shapes if args.fresh else []) for r in
                  measure_fresh(s, dtypes, args.fresh, args.baseline)]
    report = {"machine": machine(), "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
              "fresh": fresh_rows, "baseline": args.baseline, "command": " ".join(["python -m benchmarks.model_load",
                                                                                    *(argv or sys.argv[1:])])}
    print(f"{machine()}, {torch.get_num_threads()} torch threads; median of {args.repeats}")
    print(f"{'shape':<10}{'built+loaded s':>16}{'loaded s':>10}{'saved s':>9}{'load+1st batch s':>18}"
          f"{'invariant: checking s':>23}{'checked s':>11}{'row check s':>13}")
    for r in rows:
        old, new = statistics.median(r["built_then_loaded_s"]), statistics.median(r["loaded_s"])
        checking, checked = (statistics.median(r[k]) for k in ("invariant_first_batch_checking_s",
                                                                "invariant_first_batch_checked_s"))
        print(f"{r['shape']:<10}{old:>16.3f}{new:>10.3f}{old - new:>9.3f}"
              f"{statistics.median(r['load_and_first_batch_s']):>18.3f}{checking:>23.3f}{checked:>11.3f}"
              f"{checking - checked:>13.3f}")
    if fresh_rows:
        print(f"fresh processes, median of {args.fresh} (seconds):")
        print(f"{'shape':<10}{'dtype':<10}{'tree':<11}" + "".join(f"{c[:-2]:>18}" for c in FRESH_COLUMNS))
        for r in fresh_rows:
            print(f"{r['shape']:<10}{r['dtype']:<10}{r['tree']:<11}" + "".join(f"{r[c]:>18.2f}" for c in FRESH_COLUMNS))
    write_result(report, args.out, "model_load")
    return report


if __name__ == "__main__":
    main()
