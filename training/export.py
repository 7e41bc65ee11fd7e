"""Export a trained biLM (options.json + weights.hdf5 in the bilm-tf layout + vocab.txt) and load it back.

An export is whole or refused: sha256sums.txt, written last, records its files (as a shipped model's does) and every
load checks them; an export replaces only an export's own files. The LM softmax is not part of bilm-tf's inference
weights: export_model adds it to weights.hdf5 as 'softmax/<parameter name>' datasets, which load_bilm, AllenNLP and
bilm-tf ignore; evaluation and --init-from read them when present.
"""
from __future__ import annotations

import os

import h5py

from elmo_pipeline.fsio import atomic_write, only_a_file, url_fs
from elmo_pipeline.model.options import read_options_file
from elmo_pipeline.model.pretrained import SUMS, verify_model_folder
from elmo_pipeline.training.checkpoint import check_vocab, load_checkpoint, read_meta, read_tensors, shapes_of
from elmo_pipeline.training.head import LMHead, build_model
from elmo_pipeline.model.vocab import Vocabulary
from elmo_pipeline.model.weights import load_weights_into, save_bilm

EXPORT_FILES = ("options.json", "weights.hdf5", "vocab.txt")
WRITING = ".elmo-export-writing"   # an export under way: the names it may replace, one a line (gone once SUMS is)


def export_model(head: LMHead, vocab: Vocabulary, folder: str, include_softmax: bool = True) -> tuple[str, str, str]:
    """options.json + weights.hdf5 (bilm-tf layout; the softmax as extra 'softmax/...' datasets that
    inference loaders ignore) + vocab.txt, then sha256sums.txt (SUMS, as a shipped model's: the record of a whole
    export, checked by every load). Only over nothing or an export's own files (check_export_targets); an export
    killed midway leaves WRITING (no SUMS): loads refuse the folder, a rerun replaces it. Returns the three paths."""
    os.makedirs(folder, exist_ok=True)
    check_export_targets(folder)
    paths = [os.path.join(folder, n) for n in EXPORT_FILES]
    fs = url_fs(folder)[0]
    atomic_write(fs, os.path.join(folder, WRITING), "".join(n + "\n" for n in (*EXPORT_FILES, SUMS)).encode(),
                 files_only=True)
    if os.path.lexists(os.path.join(folder, SUMS)):
        os.remove(os.path.join(folder, SUMS))        # unfinished from here until the new record is written
    softmax = {f"softmax/{name}": t.detach().cpu().float().numpy() for name, t in head.softmax.state_dict().items()}
    opts_path, weights_path, vocab_path = paths
    save_bilm(head.bilm, opts_path, weights_path, softmax if include_softmax else None)     # in one file, whole
    vocab.save(vocab_path)
    atomic_write(fs, os.path.join(folder, SUMS), "".join(f"{_sha256(p)}  {os.path.basename(p)}\n"
                                                         for p in paths).encode(), files_only=True)
    os.remove(os.path.join(folder, WRITING))
    return opts_path, weights_path, vocab_path


def check_export_targets(folder: str) -> None:
    """FileExistsError unless each of the export's names in `folder` is nothing or a regular file (fsio.only_a_file)
    that an export wrote: named by the folder's sha256sums.txt or by an unfinished export's WRITING. A user's files
    of those names, or a sha256sums.txt not an export's, are left as they are."""
    own = set()
    for name in (SUMS, WRITING):
        path = os.path.join(folder, name)
        only_a_file(path)
        if os.path.lexists(path):
            names = _listed(path, name == SUMS)
            if names is None:
                raise FileExistsError(f"{path} exists and is not a file an export wrote: it is left as it is; move it "
                                      "away or name another folder")
            own.update(names)
    for name in EXPORT_FILES:
        path = os.path.join(folder, name)
        only_a_file(path)
        if os.path.lexists(path) and name not in own:
            raise FileExistsError(f"{path} exists and is not a file an export wrote: it is left as it is; move it "
                                  "away or name another folder")


def _listed(path: str, sums: bool) -> set[str] | None:
    """The export's names a SUMS (sums) or WRITING file lists; None when it is not one an export writes (a line of
    another form, another name, or more than such a file holds)."""
    with open(path, "rb") as f:
        data = f.read(4097)
    if len(data) > 4096:
        return None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None
    allowed = set(EXPORT_FILES) | ({SUMS} if not sums else set())
    names = set()
    for line in lines:
        parts = line.split("  ") if sums else ["0" * 64, line]
        if len(parts) != 2 or len(parts[0]) != 64 or set(parts[0]) - set("0123456789abcdef") or parts[1] not in allowed:
            return None
        names.add(parts[1])
    return names


def _sha256(path: str) -> str:
    """The SHA-256 of a local file, read in 8 MiB blocks."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def check_exported(folder: str) -> None:
    """ValueError, one phrase, unless the exported `folder` is whole: no unfinished export (WRITING), and where it
    records its files (sha256sums.txt, as every export and shipped model does) each of them of its recorded digest.
    A folder without either (an earlier version's export, or files put together by hand) is read as it is."""
    if os.path.lexists(os.path.join(folder, WRITING)):
        raise ValueError(f"{folder}: an export that did not finish (it was interrupted): export it again")
    verify_model_folder(folder)


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
    """Fill head.softmax from a weights.hdf5's 'softmax/...' datasets when present and of the right shapes."""
    want = shapes_of(head.softmax)
    with h5py.File(weights_path, "r") as f:
        if "softmax" not in f:
            return False
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
