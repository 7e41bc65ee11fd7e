"""Every file of an output recorded by content (output/sink.py, output/finalize.py): its size and SHA-256, taken
while it is written, listed in manifest.json's "files" under its final name."""
import hashlib
import io
import json
import os
import re
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elmo_pipeline.output.manifest import file_records, is_file_record
from elmo_pipeline.output.sink import DigestWriter, Sink
from tests.pipeline_helpers import run_pipeline


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12))
def test_a_digest_writer_records_exactly_what_passes(chunks):
    raw = io.BytesIO()
    w = DigestWriter(raw)
    for c in chunks:
        assert w.write(bytearray(c)) == len(c)
    data = b"".join(chunks)
    assert raw.getvalue() == data and w.tell() == len(data)
    assert w.record() == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_sink_records_its_writes_and_follows_its_moves(tmp_path):
    sink, root = Sink.at(str(tmp_path))
    with sink.open(f"{root}/a/x.bin") as f:
        f.write(b"abc")
    sink.put(f"{root}/y.json", b"{}")
    sink.move(f"{root}/a/x.bin", f"{root}/b/x.bin")
    assert sink.written == {f"{root}/b/x.bin": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
                            f"{root}/y.json": {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}}


def test_file_records_leave_out_what_no_record_vouches_for():
    from elmo_pipeline.formats.layout import ShardInfo
    good = {"bytes": 1, "sha256": "a" * 64}
    shards = [ShardInfo({"parquet": "s/1.parquet", "hdf5": "s/1.hdf5"}, 1, 1, "x",
                        {"digests": {"parquet": good, "hdf5": {"bytes": True, "sha256": "a" * 64}}}),
              ShardInfo({"parquet": "s/2.parquet"}, 1, 1, "y", {"digests": ["damaged"]}),
              ShardInfo({"parquet": "s/3.parquet"}, 1, 1, "z")]              # committed without digests
    moves = [["s/1.parquet", "parquet/p0"], ["s/1.hdf5", "hdf5/p0"], ["s/2.parquet", "parquet/p1"],
             ["s/3.parquet", "parquet/p2"], ["s/r.html", "report.html"]]
    assert file_records(moves, shards, {"s/r.html": good}) == {"parquet/p0": good, "report.html": good}
    assert not is_file_record({"bytes": -1, "sha256": "a" * 64}) and not is_file_record({"bytes": 1, "sha256": "A" * 64})


def test_the_manifest_lists_every_file_of_the_output_by_size_and_digest(tmp_path, tiny_model_files):
    """Shards of every format, the key index, dead letters, the report and metrics: each file in the folder but
    manifest.json and _SUCCESS is listed, with the size and SHA-256 of the bytes on disk."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"d{i}", "text": f"the cat {i} sat on the mat ."}) + "\n"
                           for i in range(30)) + "{broken\n", encoding="utf-8")
    out = str(tmp_path / "out")
    _, m = run_pipeline(tiny_model_files, str(inp), out, "--input-format", "jsonl", "--id-field", "id",
                        "--format", "parquet,hdf5,arrow", "--shard-sentences", "10")
    on_disk = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs} - {"manifest.json",
                                                                                                   "_SUCCESS"}
    assert m["dead_letter_files"] and len(m["shards"]) == 3
    assert set(m["files"]) == on_disk
    for name, rec in m["files"].items():
        data = open(os.path.join(out, name), "rb").read()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_model_files):
    """Two finished outputs of one corpus, the same counts and layout, from two models (another seed)."""
    from elmo_pipeline.model.synthetic import write_random_bilm
    d = tmp_path_factory.mktemp("two")
    inp = d / "in.txt"
    inp.write_text("".join(f"the cat {i} sat on the mat .\n" for i in range(20)), encoding="utf-8")
    other = write_random_bilm("tiny", str(d / "other"), seed=7)
    outs = {}
    for name, files in (("a", tiny_model_files), ("b", other)):
        outs[name] = str(d / name)
        run_pipeline(files, str(inp), outs[name], "--format", "parquet,hdf5,arrow", "--shard-sentences", "10",
                     "--tokenizer", "whitespace")
    return outs


def test_a_shard_of_another_model_with_the_same_counts_is_refused(two_models, tmp_path):
    """Row 2 of the issue: an Arrow, HDF5 or Parquet shard of another model, same counts, copied in: validate()
    refuses it (its SHA-256), and readers refuse it on open (its size, where it differs); a FIFO planted at a
    shard's path is refused, never opened (no hang)."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    m = json.load(open(os.path.join(two_models["a"], "manifest.json")))
    for fmt in ("arrow", "hdf5", "parquet"):
        out = str(tmp_path / fmt)
        shutil.copytree(two_models["a"], out)
        rel = m["shards"][1][fmt]
        shutil.copy(os.path.join(two_models["b"], rel), os.path.join(out, rel))
        ElmoOutput(two_models["a"]).validate()
        with pytest.raises(DamagedOutput, match=re.escape(rel)):
            ElmoOutput(out).validate()
    out = str(tmp_path / "fifo")
    shutil.copytree(two_models["a"], out)
    rel = m["shards"][0]["parquet"]
    os.remove(os.path.join(out, rel))
    os.mkfifo(os.path.join(out, rel))
    for read in (lambda: ElmoOutput(out).validate(), lambda: list(ElmoOutput(out).sentences("parquet"))):
        with pytest.raises(DamagedOutput, match="not a regular file"):
            read()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_any_single_byte_change_or_cut_of_a_recorded_file_is_refused(two_models, tmp_path_factory, data):
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    names = sorted(json.load(open(os.path.join(two_models["a"], "manifest.json")))["files"])
    name = data.draw(st.sampled_from(names))
    out = str(tmp_path_factory.mktemp("h") / "o")
    shutil.copytree(two_models["a"], out)
    path = os.path.join(out, name)
    raw = bytearray(open(path, "rb").read())
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    else:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    open(path, "wb").write(bytes(raw))
    with pytest.raises(DamagedOutput, match=re.escape(name)):
        ElmoOutput(out).validate()
