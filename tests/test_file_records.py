"""Every file of an output recorded by content (output/sink.py, output/finalize.py): its size and SHA-256, taken
while it is written, listed in manifest.json's "files" under its final name."""
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager

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
    from elmo_pipeline.downstream import ElmoOutput, to_arrow_table
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
    with never_opened(os.path.join(out, rel)):         # hdf5 reads its Parquet twin's ids; to_arrow_table the Parquet
        for read in (lambda: ElmoOutput(out).validate(), lambda: list(ElmoOutput(out).sentences("parquet")),
                     lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: to_arrow_table(out)):
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


@contextmanager
def never_opened(fifo: str, may_open: bool = False, grace: float = 2.0):
    """Guard of a test planting a FIFO: a watchdog thread opens its write end whenever a reader has opened it (a
    non-blocking open for writing succeeds only then), so a reader blocked on it is let go (it reads an empty
    file) instead of hanging the test. On exit, fails if any reader opened it; `may_open` (a reader may open it
    without blocking): the watchdog starts after `grace` seconds, and fails if the block took that long."""
    stop, seen = threading.Event(), []

    def watch():
        if may_open:
            stop.wait(grace)
        while not stop.wait(0.005):
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:                     # ENXIO: no reader has it open
                continue
            seen.append(time.monotonic())
            os.close(fd)

    t = threading.Thread(target=watch, daemon=True)
    start = time.monotonic()
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    assert not seen, f"{fifo}: a reader opened the FIFO and waited on it"
    assert time.monotonic() - start < grace or not may_open, f"{fifo}: a reader waited on the FIFO"


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def _manifest(out: str) -> dict:
    return json.load(open(os.path.join(out, "manifest.json")))


def _write_manifest(out: str, m: dict) -> None:
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("fmt", ["parquet", "hdf5", "arrow"])
@pytest.mark.parametrize("change", ["append", "cut"])
def test_a_shard_of_another_size_is_refused_when_opened(two_models, tmp_path, fmt, change):
    """One byte appended to or cut from a shard: reading it (ElmoOutput, and MappedDataset for Arrow) is one
    DamagedOutput naming it with both sizes, before anything of it is parsed."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    m = _manifest(out)
    rel = m["shards"][0][fmt]
    path, size = os.path.join(out, rel), m["files"][rel]["bytes"]
    if change == "append":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(path, size - 1)
    new = size + 1 if change == "append" else size - 1
    want = re.escape(f"{path}: {new} bytes, the manifest records {size}")
    with pytest.raises(DamagedOutput, match=want):
        list(ElmoOutput(out).sentences(fmt))
    if fmt == "arrow":
        with pytest.raises(DamagedOutput, match=want):
            MappedDataset(out)


def test_a_fifo_at_an_arrow_shard_never_blocks_the_mapped_dataset(two_models, tmp_path):
    """A FIFO planted at an Arrow shard: MappedDataset refuses it without opening it, with or without the
    manifest's records (an output of a version that recorded none); so does ElmoOutput."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    m = _manifest(out)
    fifo = os.path.join(out, m["shards"][1]["arrow"])
    os.remove(fifo)
    os.mkfifo(fifo)
    with never_opened(fifo):
        for recorded in (True, False):
            for read in (lambda: MappedDataset(out), lambda: list(ElmoOutput(out).sentences("arrow"))):
                with pytest.raises(DamagedOutput, match=re.escape(fifo) + ": not a regular file"):
                    read()
            if not recorded:
                break
            m.pop("files"), m.pop("kernel_path")         # an output of a version that recorded no files
            _write_manifest(out, m)
            assert ElmoOutput(out).files is None


def test_a_shard_replaced_by_a_fifo_after_opening_is_refused(two_models, tmp_path):
    """A FIFO renamed over an Arrow shard after the dataset was opened: a batch read opens it without blocking and
    refuses it (not the file indexed), or reads the file it mapped; never a hang."""
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    ds = MappedDataset(out)
    ds.files.close()                                            # the descriptors kept: opened again by path
    path = os.path.join(out, _manifest(out)["shards"][0]["arrow"])
    os.mkfifo(path + ".fifo")
    os.replace(path + ".fifo", path)
    with never_opened(path, may_open=True), pytest.raises(DamagedOutput, match="replaced since the dataset"):
        ds.batch([0, 1])
    ds._maps.clear()                                            # its map dropped: mapped again by path
    with never_opened(path), pytest.raises(DamagedOutput, match=re.escape(path) + ": not a regular file"):
        ds.views(0)


def test_an_output_without_records_reads_as_before(two_models, tmp_path):
    """An output of a version that recorded no files: read and validated as before (a shard swapped in with the
    same counts is not detected: nothing records it). A manifest that lost its records but keeps what the versions
    recording them write (kernel_path) is refused: edited or damaged, not an earlier version's."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    m = _manifest(out)
    del m["files"]
    _write_manifest(out, m)
    for read in (ElmoOutput, MappedDataset):
        with pytest.raises(DamagedOutput, match=re.escape("has no file records ('files'), which its version always "
                                                          "writes: edited or damaged")):
            read(out)
    del m["kernel_path"]
    _write_manifest(out, m)
    rel = m["shards"][1]["parquet"]
    shutil.copy(os.path.join(two_models["b"], rel), os.path.join(out, rel))
    o = ElmoOutput(out)
    assert o.files is None
    o.validate()
    assert len(list(o.sentences("parquet"))) == len(MappedDataset(out)) == o.num_sentences == 20


def test_validate_wants_every_shard_recorded_readers_check_what_is(two_models, tmp_path):
    """A shard the manifest's files leave out (committed by a version without digests): readers read it (they check
    what is recorded), validate() refuses the output naming it; a recorded file other than a shard that is gone
    (the report deleted) is left out of validate(), a recorded shard that is gone is not."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    m = _manifest(out)
    os.remove(os.path.join(out, "report.html"))
    assert "report.html" in m["files"]
    ElmoOutput(out).validate()
    rel = m["shards"][1]["hdf5"]
    del m["files"][rel]
    _write_manifest(out, m)
    assert len(list(ElmoOutput(out).sentences("hdf5"))) == 20
    with pytest.raises(DamagedOutput, match=re.escape(rel) + ": not recorded in the manifest"):
        ElmoOutput(out).validate()
    _write_manifest(out, _manifest(two_models["a"]))
    rel = m["shards"][0]["arrow"]
    os.remove(os.path.join(out, rel))
    with pytest.raises(DamagedOutput, match=re.escape(rel) + ": cannot be read"):
        ElmoOutput(out).validate()


@pytest.mark.parametrize("files", [
    [], {"report.html": {"bytes": True, "sha256": "a" * 64}}, {"report.html": {"bytes": -1, "sha256": "a" * 64}},
    {"report.html": {"bytes": 1, "sha256": "A" * 64}}, {"report.html": {"bytes": 1, "sha256": "a" * 63}},
    {"report.html": {"bytes": 1.0, "sha256": "a" * 64}}, {"report.html": "a" * 64},
    {"../x": {"bytes": 1, "sha256": "a" * 64}}, {"/etc/passwd": {"bytes": 1, "sha256": "a" * 64}}])
def test_a_damaged_files_record_is_refused_on_open(two_models, tmp_path, files):
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    _write_manifest(out, {**_manifest(out), "files": files})
    with pytest.raises(DamagedOutput, match=re.escape(os.path.join(out, "manifest.json"))):
        ElmoOutput(out)


def test_a_recorded_file_linked_to_dev_zero_or_grown_is_refused(two_models, tmp_path):
    """A recorded file linked to /dev/zero is never read (not a regular file); a file that passes the size check
    but holds more (grown meanwhile: a store's size out of date) is read to its recorded size + 1 bytes only."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput, check_file
    out = _copy(two_models["a"], tmp_path / "o")
    os.remove(os.path.join(out, "metrics.prom"))
    os.symlink("/dev/zero", os.path.join(out, "metrics.prom"))
    with pytest.raises(DamagedOutput, match="metrics.prom: not a regular file"):
        ElmoOutput(out).validate()

    class Endless(io.RawIOBase):
        read_bytes = 0

        def readable(self):
            return True

        def readinto(self, b):
            Endless.read_bytes += len(b)
            b[:] = bytes(len(b))
            return len(b)

    class Store:                                # a remote store whose listing says the recorded size
        protocol = "s3"

        def size(self, path):
            return 10 << 20

        def open(self, path, mode):
            return io.BufferedReader(Endless(), 1 << 16)

    record = {"bytes": 10 << 20, "sha256": hashlib.sha256(bytes(10 << 20)).hexdigest()}
    with pytest.raises(DamagedOutput, match="s3-bucket/x: not the file the manifest records"):
        check_file(Store(), "s3-bucket/x", record, digest=True)
    assert Endless.read_bytes <= (10 << 20) + (1 << 16) + 1
    check_file(Store(), "s3-bucket/x", record)                       # the size alone: no read


def test_validate_reads_each_recorded_file_once(two_models, tmp_path, monkeypatch):
    """validate() digests every file the manifest records, each once (a shard is not hashed again as a shard)."""
    from collections import Counter
    from elmo_pipeline.downstream import ElmoOutput, shard_checks
    out = _copy(two_models["a"], tmp_path / "o")
    seen, real = Counter(), shard_checks.same_digest
    monkeypatch.setattr(shard_checks, "same_digest", lambda fs, path, rec: seen.update([path]) or real(fs, path, rec))
    ElmoOutput(out).validate()
    assert seen == Counter({os.path.join(out, name): 1 for name in _manifest(out)["files"]})


def test_the_size_mapped_is_the_recorded_one(two_models, tmp_path, monkeypatch):
    """A shard rewritten in place between its check and its map (the same file, a valid Arrow file of its counts
    and another size): the index refuses the size it mapped."""
    import pyarrow as pa
    from elmo_pipeline.downstream import mapped
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    rel = _manifest(out)["shards"][0]["arrow"]
    path, size, real = os.path.join(out, rel), _manifest(out)["files"][rel]["bytes"], mapped.map_arrow_shard

    def grow_then_map(local: str, *args, **kw):
        if local == path:
            batch = pa.ipc.open_file(pa.BufferReader(open(local, "rb").read())).get_batch(0)
            with open(local, "wb") as f, pa.ipc.new_file(f, batch.schema.with_metadata({"x": "y"})) as w:
                w.write_batch(batch)
        return real(local, *args, **kw)
    monkeypatch.setattr(mapped, "map_arrow_shard", grow_then_map)
    with pytest.raises(DamagedOutput, match=re.escape(f"{path}: ") + r"\d+ bytes, " + f"the manifest records {size}"):
        mapped.MappedDataset(out)


def test_a_remote_shard_is_checked_before_it_is_copied(two_models, tmp_path):
    """A remote (fsspec memory://) output: MappedDataset reads it through local copies; a shard of another size is
    refused naming its URL path before any of it is copied."""
    import fsspec
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.mapped import MappedDataset
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    fs, src = fsspec.filesystem("memory"), two_models["a"]
    for d, _, names in os.walk(src):
        for name in names:
            fs.pipe(f"/records/{os.path.relpath(os.path.join(d, name), src)}", open(os.path.join(d, name), "rb").read())
    ds = MappedDataset("memory://records", cache_dir=str(tmp_path / "c1"))
    assert [ds[i]["id"] for i in range(len(ds))] == [r["id"] for r in ElmoOutput(src).sentences("arrow")]
    rel = _manifest(src)["shards"][1]["arrow"]
    fs.pipe(f"/records/{rel}", open(os.path.join(src, rel), "rb").read() + b"\0")
    with pytest.raises(DamagedOutput, match=re.escape(f"/records/{rel}: ")):
        MappedDataset("memory://records", cache_dir=str(tmp_path / "c2"))
    assert not any(name == os.path.basename(rel) for _, _, names in os.walk(tmp_path / "c2") for name in names)
    fs.rm("/records", recursive=True)


def test_validate_allows_only_the_renderings_to_be_gone(two_models, tmp_path):
    """A recorded data file gone (a key index) is a damaged output; the run's renderings (report.html,
    metrics.prom) deleted by hand are not."""
    import shutil

    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = str(tmp_path / "out")
    shutil.copytree(two_models["a"], out)
    os.remove(os.path.join(out, "report.html"))
    os.remove(os.path.join(out, "metrics.prom"))
    ElmoOutput(out).validate()
    os.remove(os.path.join(out, "keys", "part-00000-of-00002.parquet"))
    with pytest.raises(DamagedOutput, match=r"keys/part-00000-of-00002\.parquet"):
        ElmoOutput(out).validate()


def _readers(out):
    """Every way to read an output's vectors back: each format's records, the table, the mapped dataset."""
    from elmo_pipeline.downstream import ElmoOutput, to_arrow_table
    from elmo_pipeline.downstream.mapped import MappedDataset
    return {"parquet": lambda: list(ElmoOutput(out).sentences("parquet")),
            "hdf5": lambda: list(ElmoOutput(out).sentences("hdf5")),
            "arrow": lambda: list(ElmoOutput(out).sentences("arrow")),
            "table": lambda: to_arrow_table(out), "mapped": lambda: MappedDataset(out)[19]}


@pytest.mark.parametrize("fmt", ["parquet", "hdf5", "arrow"])
def test_a_shard_changed_at_its_size_is_refused_by_every_reader(two_models, tmp_path, fmt):
    """A shard rewritten at its recorded size (one byte changed mid-file: a vector's value; or another model's shard
    of the same size): every reader that opens it refuses it by its SHA-256 (before: read as if whole, the
    changed vector served); ElmoOutput(verify="size") reads it (the documented opt-out)."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    out = _copy(two_models["a"], tmp_path / "o")
    rel = _manifest(out)["shards"][1][fmt]
    raw = bytearray(open(os.path.join(out, rel), "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(os.path.join(out, rel), "wb").write(bytes(raw))
    opened = {"parquet": ["parquet", "hdf5", "table"], "hdf5": ["hdf5"], "arrow": ["arrow", "mapped"]}[fmt]
    for name, read in _readers(out).items():
        if name in opened:
            with pytest.raises(DamagedOutput, match=re.escape(f"{rel}: not the file the manifest records (its "
                                                              "SHA-256 differs)")):
                read()
    try:                                       # what the size-only opt-out does is the file's business: no crash
        list(ElmoOutput(out, verify="size").sentences(fmt))
    except DamagedOutput:
        pass
    other = os.path.join(two_models["b"], rel)
    if os.path.getsize(other) == len(raw):
        shutil.copy(other, os.path.join(out, rel))
        with pytest.raises(DamagedOutput, match="SHA-256 differs"):
            list(ElmoOutput(out).sentences(fmt))
        assert len(list(ElmoOutput(out, verify="size").sentences(fmt))) == 20


def test_a_link_in_an_output_is_never_followed(two_models, tmp_path):
    """A shard replaced by a link (even to a copy of the very file recorded) and a shard folder replaced by a link
    to a copy of it: refused by every reader and validate(), as not the output's own (before: followed, so a link to
    another output's shard of the same size served its vectors)."""
    from elmo_pipeline.downstream import ElmoOutput
    from elmo_pipeline.downstream.shard_checks import DamagedOutput
    elsewhere = _copy(two_models["a"], tmp_path / "elsewhere")
    for fmt in ("parquet", "hdf5", "arrow"):
        out = _copy(two_models["a"], tmp_path / f"file-{fmt}")
        rel = _manifest(out)["shards"][0][fmt]
        os.remove(os.path.join(out, rel))
        os.symlink(os.path.join(elsewhere, rel), os.path.join(out, rel))
        with pytest.raises(DamagedOutput, match=re.escape(f"{rel}: not a regular file (a link)")):
            ElmoOutput(out).validate()
        for name, read in _readers(out).items():
            if name == fmt or (fmt, name) in {("parquet", "table"), ("parquet", "hdf5"), ("arrow", "mapped")}:
                with pytest.raises(DamagedOutput, match="not a regular file"):
                    read()
        out = _copy(two_models["a"], tmp_path / f"folder-{fmt}")
        shutil.rmtree(os.path.join(out, fmt))
        os.symlink(os.path.join(elsewhere, fmt), os.path.join(out, fmt))
        with pytest.raises(DamagedOutput, match=re.escape(f"{fmt}: a link, not a folder of the output")):
            ElmoOutput(out).validate()
        with pytest.raises(DamagedOutput, match="a link, not a folder of the output"):
            list(ElmoOutput(out).sentences(fmt))


def test_readers_hash_a_shard_once_per_process_and_again_when_it_changes(two_models, tmp_path, monkeypatch):
    """Opened again and again, a shard is hashed once; rewritten since (same size, new contents), it is hashed
    again and refused."""
    from collections import Counter
    from elmo_pipeline.downstream import ElmoOutput, shard_checks
    out = _copy(two_models["a"], tmp_path / "o")
    seen, real = Counter(), shard_checks.same_digest
    monkeypatch.setattr(shard_checks, "same_digest", lambda fs, path, rec: seen.update([path]) or real(fs, path, rec))
    for _ in range(3):
        assert len(list(ElmoOutput(out).sentences("parquet"))) == 20
    shards = [os.path.join(out, s["parquet"]) for s in _manifest(out)["shards"]]
    assert seen == Counter(dict.fromkeys(shards, 1))
    raw = bytearray(open(shards[0], "rb").read())
    raw[len(raw) // 2] ^= 0x01
    st = os.stat(shards[0])
    with open(shards[0], "r+b") as f:          # in place, at its size, its times put back (as cp -p, rsync -t)
        f.write(bytes(raw))
    os.utime(shards[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(shard_checks.DamagedOutput, match="SHA-256 differs"):
        list(ElmoOutput(out).sentences("parquet"))
    assert seen[shards[0]] == 2


@pytest.mark.slow
def test_a_mapped_dataset_unpickled_in_another_process_checks_its_shards_there(two_models, tmp_path):
    """A MappedDataset pickled (as a spawn DataLoader hands it to its workers), its shard then changed in place at
    its size: the copy in the new process refuses it by its SHA-256 (before: served the changed vectors)."""
    import pickle
    import subprocess
    import sys
    from elmo_pipeline.downstream.mapped import MappedDataset
    out = _copy(two_models["a"], tmp_path / "o")
    ds = MappedDataset(out)
    (tmp_path / "ds.pkl").write_bytes(pickle.dumps(ds))
    shard = os.path.join(out, _manifest(out)["shards"][0]["arrow"])
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    with open(shard, "r+b") as f:
        f.write(bytes(raw))
    code = ("import pickle, sys; ds = pickle.load(open(sys.argv[1], 'rb'))\n"
            "try:\n    ds[0]\nexcept ValueError as e:\n    print(e)\nelse:\n    print('served')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds.pkl")], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "not the file the manifest records (its SHA-256 differs)" in r.stdout, r.stdout + r.stderr
