"""Export a trained biLM (options.json + weights.hdf5 in the bilm-tf layout + vocab.txt) and load it back.

The LM softmax is not part of bilm-tf's inference weights: export_model adds it to weights.hdf5 as
'softmax/<parameter name>' datasets, which load_bilm, AllenNLP and bilm-tf ignore; evaluation and
--init-from read them when present.
"""
from __future__ import annotations

import os

import h5py
import torch

from elmo_pipeline.fsio import only_a_file
from elmo_pipeline.model.options import read_options_file
from elmo_pipeline.training.checkpoint import load_checkpoint, read_meta
from elmo_pipeline.training.head import LMHead, build_model
from elmo_pipeline.model.vocab import Vocabulary
from elmo_pipeline.model.weights import load_weights_into, save_bilm

def export_model(head: LMHead, vocab: Vocabulary, folder: str, include_softmax: bool = True) -> tuple[str, str, str]:
    """options.json + weights.hdf5 (bilm-tf layout; the softmax as extra 'softmax/...' datasets that
    inference loaders ignore) + vocab.txt. Returns the three paths."""
    os.makedirs(folder, exist_ok=True)
    opts_path, weights_path, vocab_path = (os.path.join(folder, n) for n in ("options.json", "weights.hdf5", "vocab.txt"))
    for path in (opts_path, weights_path, vocab_path):      # all three before any is written
        only_a_file(path)
    softmax = {f"softmax/{name}": t.detach().cpu().float().numpy() for name, t in head.softmax.state_dict().items()}
    save_bilm(head.bilm, opts_path, weights_path, softmax if include_softmax else None)     # in one file, whole
    vocab.save(vocab_path)
    return opts_path, weights_path, vocab_path


def load_exported(folder: str, require_softmax: bool = True) -> tuple[LMHead, Vocabulary, bool]:
    """(head, vocab, softmax_loaded) from an exported folder (options.json, weights.hdf5, vocab.txt)."""
    options = read_options_file(os.path.join(folder, "options.json"))
    vocab_path = os.path.join(folder, "vocab.txt")
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"{folder}: no vocab.txt (needed for the softmax)")
    vocab = Vocabulary.load(vocab_path)
    head = build_model(options, vocab)
    weights = os.path.join(folder, "weights.hdf5")
    load_weights_into(head.bilm, weights)
    loaded = load_softmax(head, weights)
    if require_softmax and not loaded:
        raise ValueError(f"{weights} holds no softmax (an inference-only export): perplexity needs it")
    return head, vocab, loaded


def load_softmax(head: LMHead, weights_path: str) -> bool:
    """Fill head.softmax from a weights.hdf5's 'softmax/...' datasets when present and of the right shapes."""
    want = head.softmax.state_dict()
    with h5py.File(weights_path, "r") as f:
        if "softmax" not in f:
            return False
        got = {}
        f["softmax"].visititems(lambda n, o: got.__setitem__(n, torch.from_numpy(o[()])) if isinstance(o, h5py.Dataset) else None)
    if set(got) != set(want) or any(got[k].shape != want[k].shape for k in want):
        return False
    head.softmax.load_state_dict(got)
    return True


def head_from_checkpoint(path: str) -> tuple[LMHead, Vocabulary, dict]:
    """(head, vocab, meta) from a checkpoint file; its vocab.txt is the run folder's (one level up)."""
    meta = read_meta(path)
    vocab = Vocabulary(meta["vocab"]) if "vocab" in meta else Vocabulary.load(
        os.path.join(os.path.dirname(os.path.dirname(path)), "vocab.txt"))
    head = build_model(meta["options"], vocab)
    load_checkpoint(path, head.bilm, head.softmax, restore_rng=False)
    return head.eval(), vocab, meta
