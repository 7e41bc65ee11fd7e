"""Export a trained biLM (options.json + weights.hdf5 in the bilm-tf layout + vocab.txt) and load it back.

An export is whole or refused: sha256sums.txt, written last, records its files (as a shipped model's does) and every
load checks them; an export replaces only an export's own files. The LM softmax is not part of bilm-tf's inference
weights: export_model adds it to weights.hdf5 as 'softmax/<parameter name>' datasets, which load_bilm, AllenNLP and
bilm-tf ignore; evaluation and --init-from read them when present.
"""
from __future__ import annotations

import json
import os

import h5py

from elmo_pipeline.fsio import atomic_write, file_sha256, only_a_file, read_json, remove_temp_files, url_fs
from elmo_pipeline.model.options import read_options_file
from elmo_pipeline.model.pretrained import SUMS, verify_model_folder
from elmo_pipeline.training.checkpoint import check_vocab, load_checkpoint, read_meta, read_tensors, shapes_of
from elmo_pipeline.training.head import LMHead, build_model
from elmo_pipeline.model.vocab import Vocabulary
from elmo_pipeline.model.weights import load_weights_into, save_bilm

EXPORT_FILES = ("options.json", "weights.hdf5", "vocab.txt")
# The record that a folder's exported names are an export's own, and whether it finished: {"written_by": WRITTEN_BY,
# "state": "writing" | "whole"}, written before any other file and rewritten "whole" once SUMS is.
OWNER, WRITTEN_BY = ".elmo-export", "elmo-pipeline export"


def export_model(head: LMHead, vocab: Vocabulary, folder: str, include_softmax: bool = True) -> tuple[str, str, str]:
    """options.json + weights.hdf5 (bilm-tf layout; the softmax as extra 'softmax/...' datasets that
    inference loaders ignore) + vocab.txt, then sha256sums.txt (SUMS, as a shipped model's: the record every load
    checks). Only over nothing or an export's own files (check_export_targets); an export killed midway leaves OWNER
    "writing": loads refuse the folder, a rerun replaces it. Returns the three paths."""
    os.makedirs(folder, exist_ok=True)
    check_export_targets(folder)
    paths = [os.path.join(folder, n) for n in EXPORT_FILES]
    fs = url_fs(folder)[0]
    remove_temp_files(fs, folder, (OWNER, *EXPORT_FILES, SUMS))     # a killed export's, in a folder that is an export's
    _mark(fs, folder, "writing")
    if os.path.lexists(os.path.join(folder, SUMS)):
        os.remove(os.path.join(folder, SUMS))        # unfinished from here until the new record is written
    softmax = {f"softmax/{name}": t.detach().cpu().float().numpy() for name, t in head.softmax.state_dict().items()}
    opts_path, weights_path, vocab_path = paths
    save_bilm(head.bilm, opts_path, weights_path, softmax if include_softmax else None)     # in one file, whole
    vocab.save(vocab_path)
    atomic_write(fs, os.path.join(folder, SUMS), "".join(f"{file_sha256(p)}  {os.path.basename(p)}\n"
                                                         for p in paths).encode(), files_only=True)
    _mark(fs, folder, "whole")
    return opts_path, weights_path, vocab_path


def _mark(fs, folder: str, state: str) -> None:
    atomic_write(fs, os.path.join(folder, OWNER), json.dumps({"written_by": WRITTEN_BY, "state": state}).encode(),
                 files_only=True)


def _owner_state(folder: str) -> str | None:
    """OWNER's state ("writing" | "whole") where the folder holds an export's OWNER record; None where it holds
    none; "foreign" for a file of that name that is no such record (read at most 4 KiB)."""
    path = os.path.join(folder, OWNER)
    if not os.path.lexists(path):
        return None
    only_a_file(path)
    record = read_json(url_fs(path)[0], path, max_bytes=4096)     # None: not JSON, too large
    ok = isinstance(record, dict) and record.get("written_by") == WRITTEN_BY and record.get("state") in (
        "writing", "whole")
    return record["state"] if ok else "foreign"


def check_export_targets(folder: str) -> None:
    """FileExistsError unless each of the export's names in `folder` (its files, SUMS, OWNER) is nothing or a
    regular file (fsio.only_a_file) that an export wrote: a folder with an export's OWNER record. A user's files of
    those names (a sha256sums.txt of theirs too) are left as they are."""
    state = _owner_state(folder)
    for name in (OWNER, *EXPORT_FILES, SUMS):
        path = os.path.join(folder, name)
        only_a_file(path)
        if os.path.lexists(path) and state in (None, "foreign"):
            raise FileExistsError(f"{path} exists and is not a file an export wrote: it is left as it is; move it "
                                  "away or name another folder")


def check_exported(folder: str) -> None:
    """ValueError, one phrase, unless the exported `folder` is whole: not an unfinished export (OWNER "writing"),
    and where it records its files (sha256sums.txt, as every export and shipped model does) each of them of its
    recorded digest, an export's every file recorded. A folder without either (an earlier version's export, or files
    put together by hand) is read as it is."""
    state = _owner_state(folder)
    if state == "writing":
        raise ValueError(f"{folder}: an export that did not finish (it was interrupted): export it again")
    recorded = verify_model_folder(folder)
    held = {n for n in EXPORT_FILES if os.path.lexists(os.path.join(folder, n))}
    if state == "whole" and not held | {"options.json", "weights.hdf5"} <= set(recorded):
        raise ValueError(f"{folder}: its {SUMS} does not record each of its files ({', '.join(EXPORT_FILES)}): edited "
                         "or damaged")


def load_exported(folder: str, require_softmax: bool = True) -> tuple[LMHead, Vocabulary, bool]:
    """(head, vocab, softmax_loaded) from an exported folder (options.json, weights.hdf5, vocab.txt), checked whole
    first (check_exported)."""
    check_exported(folder)
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
        raise ValueError(f"{weights} holds no softmax of the model's shapes (an inference-only export, or a damaged "
                         "one): perplexity needs it")
    return head, vocab, loaded


def load_softmax(head: LMHead, weights_path: str) -> bool:
    """Fill head.softmax from a weights.hdf5's 'softmax/...' datasets when present and of the right shapes; a
    'softmax' that is a soft or external link is WeightsError, never followed."""
    want = shapes_of(head.softmax)
    from elmo_pipeline.model.weights import WeightsError, through_link
    with h5py.File(weights_path, "r") as f:
        if "softmax" not in f:
            return False
        if through_link(f, "softmax"):          # another file's (an external link to a FIFO blocked for good)
            raise WeightsError(f"{weights_path}: 'softmax' is a link, not a group of the file")
        found = {}                      # name -> shape, from the file's metadata: nothing read yet
        f["softmax"].visititems(lambda n, o: found.__setitem__(n, tuple(o.shape or ())) if isinstance(o, h5py.Dataset)
                                else None)
        if found != want:
            return False
        got = read_tensors(f["softmax"], want)
    head.softmax.load_state_dict(got)
    return True


def head_from_checkpoint(path: str) -> tuple[LMHead, Vocabulary, dict]:
    """(head, vocab, meta) from a checkpoint file; its vocab.txt is the run folder's (one level up)."""
    meta = read_meta(path)
    if "vocab" in meta:
        vocab = Vocabulary(meta["vocab"])
    else:
        where = os.path.join(os.path.dirname(os.path.dirname(path)), "vocab.txt")
        vocab = Vocabulary.load(where)
        check_vocab(path, meta, vocab.tokens, where)
    head = build_model(meta["options"], vocab)
    load_checkpoint(path, head.bilm, head.softmax, restore_rng=False)
    return head.eval(), vocab, meta
