"""model/resolve.py: one choice of model (a name, options + weight files, or nothing) -> its files and name."""
import json
import os

import pytest

from elmo_pipeline.fsio import file_sha256
from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
from elmo_pipeline.model.resolve import CUSTOM, ModelSpec, resolve_model


def test_nothing_given_is_the_shipped_default():
    m = resolve_model()
    assert (m.name, m.model_name, m.tokenization) == (DEFAULT_MODEL, DEFAULT_MODEL, "wikitext")
    assert (m.options_file, m.weight_file, m.vocab_file) == model_files(DEFAULT_MODEL)
    assert m.local_files() == model_files(DEFAULT_MODEL)


def test_files_given_are_custom_and_keep_their_vocabulary(tiny_model_files, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\n")
    m = resolve_model(None, *tiny_model_files, str(vocab))
    assert (m.name, m.model_name, m.tokenization) == (CUSTOM, None, None)
    assert m.local_files() == (*tiny_model_files, str(vocab))
    identity = m.identity()
    assert identity["weights_sha256"] == file_sha256(tiny_model_files[1])
    assert identity["options"] == json.load(open(tiny_model_files[0]))
    assert (identity["options_file"], identity["weight_file"], identity["vocab_file"]) == (*tiny_model_files, str(vocab))


def test_a_named_model_takes_a_given_vocabulary(tmp_path):
    vocab = str(tmp_path / "vocab.txt")
    open(vocab, "w").write("<S>\n</S>\n<UNK>\n")
    assert resolve_model(DEFAULT_MODEL, vocab_file=vocab).vocab_file == vocab


@pytest.mark.parametrize("name,options,weights", [("small", "o.json", "w.hdf5"), (None, "o.json", None),
                                                   (None, None, "w.hdf5")])
def test_files_and_a_name_or_half_the_files_are_refused(name, options, weights):
    with pytest.raises(ValueError, match=r"together \(--options-file, --weight-file\), or a model name \(--model\), not both"):
        resolve_model(name, options, weights)


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="no model named 'nope'"):
        resolve_model("nope")


def test_the_key_prefix_hashes_what_changes_the_vectors_and_nothing_else(tiny_model_files, tmp_path):
    """ModelSpec is the one identity: its key prefix changes with the weights and with every vector setting,
    not with where or how fast it runs; it needs the files' sha256 (pinned())."""
    import dataclasses
    import shutil

    from elmo_pipeline.model.resolve import VECTOR_SETTINGS, ModelSpec
    spec = resolve_model(None, *tiny_model_files)
    with pytest.raises(ValueError, match="pinned"):
        spec.key_prefix
    pinned = spec.pinned()
    assert pinned.weights_sha256 == file_sha256(tiny_model_files[1]) and len(pinned.key_prefix) == 16
    same = {"device": "cuda:1", "torch_threads": 7, "storage_options": {"s3": {"secret": "x"}},
            "options_file": str(tmp_path / "moved.json"), "model_name": "renamed"}
    for k, v in same.items():
        assert dataclasses.replace(pinned, **{k: v}).key_prefix == pinned.key_prefix, k
    changed = {"state": "warm", "batch_invariant": True, "compute_dtype": "bfloat16", "dtype": "float16",
               "layers": "2", "duplicate_layer0": True, "window": 20, "overlap": 4, "tokenizer": "moses",
               "tokenizer_version": "2"}
    assert set(changed) == set(VECTOR_SETTINGS)
    prefixes = {dataclasses.replace(pinned, **{k: v}).key_prefix for k, v in changed.items()}
    assert len(prefixes) == len(changed) and pinned.key_prefix not in prefixes
    other = tmp_path / "w.hdf5"               # other weights: another prefix
    shutil.copy(tiny_model_files[1], other)
    with open(other, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert ModelSpec(tiny_model_files[0], str(other)).pinned().key_prefix != pinned.key_prefix


def test_a_sentence_key_is_the_prefix_and_a_hash_of_the_tokens(tiny_model_files):
    spec = resolve_model(None, *tiny_model_files).pinned()
    key = spec.sentence_key(("The", "cat", "."))
    assert key.startswith(spec.key_prefix) and key == spec.sentence_key(["The", "cat", "."])
    assert key == spec.sentence_key(("The", "cat", "."), prefix=spec.key_prefix)
    assert len({key, spec.sentence_key(("The cat", ".")), spec.sentence_key(("the", "cat", ".")),
                spec.sentence_key(())}) == 4


def test_a_worker_loads_only_the_model_files_its_run_was_planned_with(tmp_path, tiny_model_files):
    """load_embedder (each pipeline worker) checks the weights and options it loads against the planned digests: a
    weight file replaced in place after planning (another model's, same shapes) is refused, never embedded with
    under the planned model's manifest and key; the model is built from the bytes that were hashed."""
    import shutil

    from elmo_pipeline.model.synthetic import write_random_bilm
    from elmo_pipeline.model.weights import WeightsError
    from elmo_pipeline.transforms.embed import load_embedder
    options, weights = (shutil.copy(p, tmp_path / os.path.basename(p)) for p in tiny_model_files)
    spec = ModelSpec(str(options), str(weights)).pinned()
    assert load_embedder(spec).model is not None
    other = write_random_bilm("tiny", str(tmp_path / "other"), seed=2)
    shutil.copy(other[1], weights)
    with pytest.raises(WeightsError, match="not the weights the run was planned with"):
        load_embedder(spec)
    shutil.copy(tiny_model_files[1], weights)
    raw = json.load(open(options))
    raw["lstm"]["cell_clip"] = 2.5
    json.dump(raw, open(options, "w"))
    with pytest.raises(ValueError, match="not the options the run was planned with"):
        load_embedder(spec)


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_a_model_file_that_is_no_regular_file_is_refused_unopened(tmp_path, kind):
    """fsio/cache.py local_path: a FIFO (its open would block), a folder or a device (/dev/zero: a read that
    never ends) given as a model file is a FileNotFoundError naming it."""
    from elmo_pipeline.fsio.cache import local_path
    path = {"fifo": str(tmp_path / "options.json"), "folder": str(tmp_path), "device": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(FileNotFoundError, match="not a regular file"):
        local_path(path)


def test_a_vocabulary_line_over_the_limit_is_refused_unread(tmp_path, monkeypatch):
    from elmo_pipeline.model import vocab
    monkeypatch.setattr(vocab, "MAX_TOKEN_CHARS", 100)
    path = tmp_path / "vocab.txt"
    path.write_text("<S>\n</S>\n<UNK>\n" + "x" * 101 + "\n")
    with pytest.raises(ValueError, match=":4: a line over 100 characters"):
        vocab.Vocabulary.load(str(path))
    path.write_text("<S>\n</S>\n<UNK>\n" + "x" * 100 + "\n")
    assert len(vocab.Vocabulary.load(str(path), size=4)) == 4


# a local path as fsspec reads it: plain, file://, file:, local://, local:, the last of a chained URL
LOCAL_SPELLINGS = ["{}", "file://{}", "file:{}", "local://{}", "local:{}", "blockcache::{}", "simplecache::file:{}"]


def _fifo_with_a_writer(path, seconds: float = 2.0):
    """A FIFO at `path` held open for writing for `seconds` (then closed: a reader that opened it sees its end), so a
    reader that opens it never blocks the test for good, whatever the code under test does."""
    import threading
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR)
    threading.Timer(seconds, os.close, (fd,)).start()


@pytest.mark.parametrize("spelling", LOCAL_SPELLINGS)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_options_file_that_is_no_regular_file_is_refused_unopened(tmp_path, kind, spelling):
    """model/options.py load_options reads through fsio.open_url, which refuses a local path that is no regular file
    (fsio/cache.py regular_file): an --options-file FIFO blocked the command and the pipeline's planning for good;
    so it did spelled as fsspec also reads a local path (`file:/p`, `blockcache::/p`: fsio.local_target)."""
    from elmo_pipeline.model.options import load_options
    path = str(tmp_path / "options.json") if kind == "fifo" else "/dev/zero"
    if kind == "fifo":
        _fifo_with_a_writer(path)
    with pytest.raises(FileNotFoundError, match="not a regular file"):
        load_options(spelling.format(path))


def test_a_download_record_that_is_no_regular_file_is_damaged_never_opened(tmp_path):
    """fsio/cache.py pinned_record: a FIFO at a published model's download record (the cache the `models` command and
    --model NAME read) is a damaged record at once; its open blocked `elmo-pipeline models` for good."""
    import time
    from elmo_pipeline.fsio.cache import RECORD_SUFFIX, pinned_record
    weights = tmp_path / "weights.hdf5"
    weights.write_bytes(b"x")
    _fifo_with_a_writer(str(weights) + RECORD_SUFFIX, seconds=5.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="a damaged download record"):
        pinned_record(str(weights))
    assert time.monotonic() - t0 < 2.0
