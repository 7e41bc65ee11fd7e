"""Distance of each state mode from the TensorFlow reference vectors (../shared/fixtures/bilm-tf).

The reference is stateful (batches of 3, state carried per row); see the fixture's README.txt. Stateful runs
with each LSTM loop (model/lstm.py: auto, onednn, bmm); stateless and warm with auto. Each row also gives the
distance of every layer from the same weights run in float64 (our own float32 rounding, whatever the reference).
Prints a table and writes --out (JSON naming the machine).
    .venv/bin/python -m benchmarks.fixture_parity [--fixtures ../shared/fixtures/bilm-tf] [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import h5py
import numpy as np
import torch

from benchmarks.common import machine
from elmo_pipeline.model import ElmoEmbedder

HERE = os.path.dirname(os.path.abspath(__file__))


def mode_diffs(fixtures: str, state: str, lstm_loop: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """|ours - TensorFlow's| of the top layer, and |ours - ours in float64| of every layer (the same weights run in
    float64 with the bmm loop: our own float32 rounding), over the fixture's 30 sentences."""
    lists = json.load(open(os.path.join(fixtures, "lm_embeddings_sentences.json")))
    order = [(k, i) for i in range(10) for k in range(3)]          # batch i = sentence i of each list
    e = ElmoEmbedder(os.path.join(fixtures, "options.json"), os.path.join(fixtures, "lm_weights.hdf5"),
                     state=state, batch_size=3, lstm_loop=lstm_loop)
    e64 = ElmoEmbedder(model=copy.deepcopy(e.model).double(), state=state, batch_size=3, lstm_loop="bmm")
    sentences = [lists[k][i].split() for k, i in order]
    out, out64 = e.embed_sentences(sentences, batch_size=3), e64.embed_sentences(sentences, batch_size=3)
    diffs, diffs64 = [], []
    for (k, i), v, v64 in zip(order, out, out64):
        with h5py.File(os.path.join(fixtures, f"lm_embeddings_{k}.hdf5"), "r") as f:
            ref = np.concatenate(f[str(i)][...], axis=-1)
        diffs.append(np.abs(v[-1] - ref).ravel())
        diffs64.append(np.abs(v.astype(np.float64) - v64).ravel())
    return np.concatenate(diffs), np.concatenate(diffs64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(HERE, "..", "..", "shared", "fixtures", "bilm-tf"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fixture_parity.json"))
    args = ap.parse_args()
    rows = []
    loops = ["auto", "onednn", "bmm"] if torch.backends.mkldnn.is_available() else ["auto"]
    for state, loop in [("stateful", loop) for loop in loops] + [("stateless", "auto"), ("warm", "auto")]:
        d, d64 = mode_diffs(args.fixtures, state, loop)
        rows.append({"state": state, "lstm_loop": loop, "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                     "values": int(d.size), "max_abs_diff_vs_float64_all_layers": float(d64.max()),
                     "mean_abs_diff_vs_float64_all_layers": float(d64.mean())})
    print(f"{'state':<10} {'loop':<7} {'max |diff|':>12} {'mean |diff|':>12}   (top layer, 30 sentences, vs TensorFlow)"
          f"   {'max / mean |diff| vs float64 (all layers)':>44}")
    for r in rows:
        print(f"{r['state']:<10} {r['lstm_loop']:<7} {r['max_abs_diff']:>12.3g} {r['mean_abs_diff']:>12.3g}"
              f"   {r['max_abs_diff_vs_float64_all_layers']:>30.3g} / {r['mean_abs_diff_vs_float64_all_layers']:.3g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "command": "python -m benchmarks.fixture_parity " + " ".join(sys.argv[1:]),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
