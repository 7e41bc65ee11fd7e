"""--reuse trusts a source's files only as its manifest records them (pipeline/reuse_sources.py, transforms/reuse.py, fsio.read_recorded): each
key index and shard it opens is read at most to its recorded size + 1 bytes, from a regular file, and used only when
its size and SHA-256 are the recorded ones; a source written before files were recorded is read as before, and one
whose manifest lost its records while keeping what the versions recording them write is refused."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from elmo_pipeline.pipeline.run import main
from elmo_pipeline.pipeline.reuse_sources import open_source
from elmo_pipeline.transforms.reuse import ReuseError, index_blobs, read_vectors
from tests.resume_helpers import argv
from tests.test_file_records import never_opened


@pytest.fixture(scope="module")
def small_sources(tiny_model_files, tmp_path_factory):
    """Small finished outputs of one corpus (20 sentences, 2 shards), Parquet and Arrow, of this run's model and of
    another model (another seed: the same counts), and a second day sharing half its sentences."""
    from elmo_pipeline.model.synthetic import write_random_bilm
    d = tmp_path_factory.mktemp("small")
    day1, day2 = d / "day1.txt", d / "day2.txt"
    day1.write_text("".join(f"the cat {i} sat on the mat .\n" for i in range(20)))
    day2.write_text("".join(f"the cat {i} sat on the mat .\n" for i in range(10, 30)))
    other = write_random_bilm("tiny", str(d / "other"), seed=7)
    flags = ("--batch-invariant", "--shard-sentences", "10", "--tokenizer", "whitespace")
    outs = {}
    for model, name in ((tiny_model_files, "ours"), (other, "foreign")):
        for fmt, extra in (("parquet", ()), ("arrow", ("--format", "arrow,hdf5"))):
            outs[name, fmt] = str(d / f"{name}-{fmt}")
            assert main(argv(model, str(day1), outs[name, fmt], *flags, *extra)) == 0
    return outs, flags, str(day2)


def _opened(src: str):
    """open_source of `src` with its own key prefix, layers and dtype (as a run of its settings would)."""
    m = json.load(open(os.path.join(src, "manifest.json")))
    return open_source(src, m["key_index"]["key_prefix"], [(n, m["layer_dims"][n]) for n in m["layers"]], m["dtype"])


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_source_file_not_the_recorded_one_is_refused_before_use(small_sources, tmp_path, fmt):
    """A source's shard or key index swapped for another model's (same counts), cut, grown by one byte, or a FIFO
    planted there: ReuseError naming it before any of its rows is used (its manifest's size and SHA-256); without
    the manifest's records (an older output) the source is read as before."""
    outs, _, _ = small_sources
    src = shutil.copytree(outs["ours", fmt], str(tmp_path / "src"))
    m = json.load(open(os.path.join(src, "manifest.json")))
    data, keys = m["shards"][1][fmt], m["shards"][1]["keys"]
    columns = [(n, m["layer_dims"][n]) for n in m["layers"]]
    good = read_vectors(_opened(src), 1, [0, 3], columns)
    shutil.copy(os.path.join(outs["foreign", fmt], data), os.path.join(src, data))
    source = _opened(src)                                            # its key indexes are the recorded ones
    with pytest.raises(ReuseError, match=f"{re.escape(data)}: not the file its manifest records"):
        read_vectors(source, 1, [0, 3], columns)
    for damage in ("foreign", "cut", "grown"):
        shutil.copy(os.path.join(outs["ours", fmt], keys), os.path.join(src, keys))
        if damage == "foreign":
            shutil.copy(os.path.join(outs["foreign", fmt], keys), os.path.join(src, keys))
        elif damage == "cut":
            os.truncate(os.path.join(src, keys), m["files"][keys]["bytes"] - 1)
        else:
            open(os.path.join(src, keys), "ab").write(b"\0")
        with pytest.raises(ReuseError, match=f"its key index {re.escape(keys)} cannot be read \\(NotTheRecordedFile: "
                                             f".*{re.escape(keys)}: not the file its manifest records"):
            _opened(src)
        with pytest.raises(ReuseError, match=f"{re.escape(keys)}: not the file its manifest records"):
            list(index_blobs(0, 1, os.path.join(src, keys), 3, None, m["files"][keys]))
    os.remove(os.path.join(src, data))
    os.mkfifo(os.path.join(src, data))
    with never_opened(os.path.join(src, data)), pytest.raises(ReuseError, match=f"{re.escape(data)}: not a regular"):
        read_vectors(source, 1, [0, 3], columns)
    os.remove(os.path.join(src, data))
    shutil.copy(os.path.join(outs["foreign", fmt], data), os.path.join(src, data))
    shutil.copy(os.path.join(outs["ours", fmt], keys), os.path.join(src, keys))
    del m["files"]                           # gone from a manifest of a version that records files: refused
    open(os.path.join(src, "manifest.json"), "w").write(json.dumps(m))
    with pytest.raises(ReuseError, match=re.escape("its manifest has no file records ('files'), which its version "
                                                   "always writes: edited or damaged")):
        _opened(src)
    del m["kernel_path"]                     # as an earlier version wrote it: read as before
    open(os.path.join(src, "manifest.json"), "w").write(json.dumps(m))
    got = read_vectors(_opened(src), 1, [0, 3], columns)              # not verified: another model's vectors
    assert got[0] == good[0] and not all(np.array_equal(a, b) for a, b in zip(got[1], good[1]))


def test_a_run_reusing_a_swapped_source_shard_fails_with_one_line(small_sources, tiny_model_files, tmp_path, capsys):
    """The run's side of row 1 of the issue (fast): --reuse of a source whose shard is another model's, same counts:
    the run fails as a worker reads it, exit 2 as for a source found damaged while planning, its last line naming
    the file, no output finished; the intact source is reused."""
    outs, flags, day2 = small_sources
    src = shutil.copytree(outs["ours", "parquet"], str(tmp_path / "src"))
    assert main(argv(tiny_model_files, day2, str(tmp_path / "ok"), *flags, "--reuse", src)) == 0
    assert json.load(open(tmp_path / "ok" / "manifest.json"))["counts"]["sentences_reused"] == 10
    rel = json.load(open(os.path.join(src, "manifest.json")))["shards"][1]["parquet"]
    shutil.copy(os.path.join(outs["foreign", "parquet"], rel), os.path.join(src, rel))
    capsys.readouterr()
    assert main(argv(tiny_model_files, day2, str(tmp_path / "r"), *flags, "--reuse", src)) == 2     # as if planning
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and f"{rel}: not the file its manifest records" in err, err
    assert not os.path.exists(tmp_path / "r" / "manifest.json")


@pytest.mark.parametrize("record", [{"bytes": -1, "sha256": "a" * 64}, {"bytes": 1, "sha256": "A" * 64},
                                    {"bytes": 1, "sha256": "a" * 63}, {"bytes": 1.0, "sha256": "a" * 64}, None])
def test_a_source_whose_manifest_records_a_shard_file_badly_is_refused(small_sources, tmp_path, record):
    """A source manifest's record of a shard's file that is not {bytes >= 0, 64 lowercase hex digits} (or none, where
    it records files): one ReuseError naming the shard's files, before any of them is read."""
    outs, _, _ = small_sources
    src = shutil.copytree(outs["ours", "parquet"], str(tmp_path / "src"))
    m = json.load(open(os.path.join(src, "manifest.json")))
    data, keys = m["shards"][1]["parquet"], m["shards"][1]["keys"]
    if record is None:
        del m["files"][data]
    else:
        m["files"][data] = record
    open(os.path.join(src, "manifest.json"), "w").write(json.dumps(m))
    want = f"records no size and SHA-256 for shard 1's files ({keys}, {data})"
    with pytest.raises(ReuseError, match=re.escape(want)):
        _opened(src)
