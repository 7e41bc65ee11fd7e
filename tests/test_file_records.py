"""Every file of an output recorded by content (output/sink.py, output/finalize.py): its size and SHA-256, taken
while it is written, listed in manifest.json's "files" under its final name."""
import hashlib
import io
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from elmo_pipeline.output.finalize import file_records, is_file_record
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
