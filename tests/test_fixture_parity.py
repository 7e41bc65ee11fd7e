"""Golden-file parity with the TensorFlow biLM (../shared/fixtures/bilm-tf, see its README.txt)."""
import json
import os

import h5py
import numpy as np
import pytest
import torch

from elmo_pipeline.model import ElmoEmbedder
from tests.conftest import TEST_DEVICE

TOLERANCE = 2e-6


def _load(fixture_dir):
    lists = json.load(open(os.path.join(fixture_dir, "lm_embeddings_sentences.json")))
    refs = []
    for k in range(3):
        with h5py.File(os.path.join(fixture_dir, f"lm_embeddings_{k}.hdf5"), "r") as f:
            refs.append([np.concatenate(f[str(i)][...], axis=-1) for i in range(10)])  # (T, 32)
    return lists, refs


def _zip_order(lists):
    """The reference's feeding order: batch i = sentence i of list 0, 1, 2."""
    return [(k, i) for i in range(10) for k in range(3)]


def top_layer_diffs(fixture_dir, state, lstm_loop=None):
    lists, refs = _load(fixture_dir)
    e = ElmoEmbedder(os.path.join(fixture_dir, "options.json"), os.path.join(fixture_dir, "lm_weights.hdf5"),
                     state=state, batch_size=3, lstm_loop=lstm_loop)
    order = _zip_order(lists)
    out = list(e.embed_sentences([lists[k][i].split() for k, i in order], batch_size=3))
    return [np.abs(v[-1] - refs[k][i]) for (k, i), v in zip(order, out)]


@pytest.mark.parametrize("loop", ["auto", "onednn", "bmm"])
def test_stateful_matches_tensorflow(fixture_dir, loop):
    """Within TOLERANCE of TensorFlow's vectors with either LSTM loop (auto picks bmm for the fixture's narrow
    layers, model.lstm.onednn_pays)."""
    if loop == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if loop == "onednn" and TEST_DEVICE != "cpu":
        pytest.skip("the onednn loop runs on a CPU only (model.lstm.step_loop refuses it elsewhere)")
    diffs = top_layer_diffs(fixture_dir, "stateful", loop)
    worst = max(d.max() for d in diffs)
    print(f"\nbilm-tf fixture, stateful, {loop} loop, batch 3: max |diff| = {worst:.3g} over "
          f"{sum(d.shape[0] for d in diffs)} tokens")
    assert len(diffs) == 30 and all(d.shape[1] == 32 for d in diffs)
    assert worst <= TOLERANCE


def test_stateless_and_warm_differ_from_stateful_reference(fixture_dir):
    """The reference is stateful: the deterministic modes must not coincide with it (else the
    stateful test above would be vacuous), but stay in the same range."""
    for state in ("stateless", "warm"):
        worst = max(d.max() for d in top_layer_diffs(fixture_dir, state))
        assert 1e-4 < worst < 2.0


def test_elmo_command_reproduces_tensorflow(fixture_dir, tmp_path):
    from elmo_pipeline.pipeline.cli import main
    lists, refs = _load(fixture_dir)
    order = _zip_order(lists)
    inp = tmp_path / "sentences.txt"
    inp.write_text("".join(lists[k][i] + "\n" for k, i in order), encoding="utf-8")
    out = tmp_path / "out.hdf5"
    assert main(["elmo", str(inp), str(out), "--all", "--state", "stateful", "--batch-size", "3",
                 "--options-file", os.path.join(fixture_dir, "options.json"),
                 "--weight-file", os.path.join(fixture_dir, "lm_weights.hdf5")]) == 0
    worst = 0.0
    with h5py.File(out, "r") as f:
        for line, (k, i) in enumerate(order):
            v = f[str(line)][...]
            assert v.shape == (3, len(lists[k][i].split()), 32)
            worst = max(worst, float(np.abs(v[-1] - refs[k][i]).max()))
    print(f"\nelmo command, stateful, batch 3: max |diff| = {worst:.3g}")
    assert worst <= TOLERANCE
