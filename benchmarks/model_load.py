"""A worker's fixed cost before its first batch: the model loaded, then its first batch embedded.

`python -m benchmarks.model_load [--shapes small medium original] [--repeats 5] [--out results/model_load_X.json]`:
per published shape (random weights written once to a temporary folder, read from the page cache), side by side
in one process, alternating:
  built then loaded   BiLM(options) (its random initialisation) + load_weights_into: what load_bilm did before
  loaded              load_bilm: the BiLM built without initialising, every parameter then loaded
  first batch         ElmoEmbedder on the loaded model, one batch of 8 WikiText-2 sentences (the weights' packing
                      and warm-up a fresh worker does first are in it)
  invariant, checked  the same with batch_invariant=True in a process that has not checked the row rule yet (every
                      row count's row check, model/row_tile.py RowRule, is in it), and again once checked: the
                      difference is the row check's cost
Each load is consumed: every parameter summed (float64), and the two ways' sums must agree. The table gives the
median seconds; the JSON (default results/model_load_<kind>.json) each repeat's, and names the machine.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import machine, wikitext_sentences, write_result


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["small", "medium", "original"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sentences = wikitext_sentences(8)
    rows = [measure(s, args.repeats, sentences) for s in args.shapes]
    report = {"machine": machine(), "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows}
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
    write_result(report, args.out, "model_load")
    return report


if __name__ == "__main__":
    main()
