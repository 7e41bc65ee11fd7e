"""Readers distrust the files of an output: damaged or hostile shards and manifests are refused with an error
naming the file (never a segmentation fault, never an allocation beyond what the manifest implies)."""
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pyarrow as pa
import pytest

from elmo_pipeline.downstream import ElmoOutput
from elmo_pipeline.downstream.mapped import MappedDataset
from elmo_pipeline.downstream.shard_checks import DamagedOutput
from tests.pipeline_helpers import run_pipeline

TEXT = ["the first line", "and a second one with more words", "third", "a fourth line here", "five"]
COMMON = ("--input-format", "lines", "--tokenizer", "whitespace", "--shard-sentences", "3")


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_model_files):
    tmp = tmp_path_factory.mktemp("damaged")
    (tmp / "a.txt").write_text("\n".join(TEXT) + "\n")
    outs = {}
    for name, flags in {"fp32": ("--format", "parquet,hdf5,arrow"),
                        "fp16": ("--format", "arrow", "--dtype", "float16")}.items():
        outs[name] = str(tmp / name)
        run_pipeline(tiny_model_files, str(tmp / "a.txt"), outs[name], *COMMON, *flags)
    return outs


@pytest.fixture
def copy(written, tmp_path):
    """A fresh copy of a written output (tampered by the test)."""
    def make(name: str) -> str:
        dst = str(tmp_path / name)
        shutil.copytree(written[name], dst)
        return dst
    return make


def _manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def _arrow_shard(out: str, i: int = 0) -> str:
    return os.path.join(out, _manifest(out)["shards"][i]["arrow"])


def _file_offset(path: str, buffer_of) -> int:
    """File offset of the buffer buffer_of(record batch) of an Arrow shard (its address in the map)."""
    source = pa.memory_map(path, "r")
    base = source.read_buffer(1).address
    buf = buffer_of(pa.ipc.open_file(source).get_batch(0))
    return buf.address - base


def _poke(path: str, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.int32(value).tobytes())


READERS = """
import sys
from elmo_pipeline.downstream import ElmoOutput
from elmo_pipeline.downstream.mapped import MappedDataset
from elmo_pipeline.downstream.sampler import BucketBatchSampler
from elmo_pipeline.downstream.shard_checks import DamagedOutput
out = sys.argv[1]
def first_record():
    return MappedDataset(out)[0]
def stream():
    return [sum(float(v.sum()) for v in b["vectors"]) for b in MappedDataset(out, tokens=False).stream()]
def sampler_batches():
    ds = MappedDataset(out)
    return list(ds.batches(BucketBatchSampler(ds.lengths, batch_size=2, shuffle=True)))
def records():
    return list(ElmoOutput(out).sentences("arrow"))
for read in (first_record, stream, sampler_batches, records):
    try:
        read()
        print(read.__name__, "read")
    except DamagedOutput as e:
        print(read.__name__, "refused:", e)
"""


def _read_in_child(out: str) -> subprocess.CompletedProcess:
    """Every Arrow reader over `out` in a child process (a segmentation fault there fails the test here)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", READERS, out], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_tampered_dictionary_offsets_refused_not_a_crash(copy):
    out = copy("fp32")
    shard = _arrow_shard(out)
    at = _file_offset(shard, lambda b: b.column("id").dictionary.buffers()[1])     # the ids' string offsets
    _poke(shard, at + 4, 0x7FFFFF00)                                                # four bytes changed
    p = _read_in_child(out)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    lines = p.stdout.splitlines()
    assert len(lines) == 4 and all("refused:" in x and shard in x for x in lines), p.stdout


def test_dictionary_codes_out_of_range_refused(copy):
    out = copy("fp32")
    shard = _arrow_shard(out)
    at = _file_offset(shard, lambda b: b.column("id").indices.buffers()[1])         # the per-token codes
    _poke(shard, at + 4, 77)                                                        # token 1: sentence 77 of 3
    with pytest.raises(DamagedOutput, match="codes"):
        MappedDataset(out)
    with pytest.raises(DamagedOutput, match=shard):
        list(ElmoOutput(out).sentences("arrow"))
    with pytest.raises(DamagedOutput):
        ElmoOutput(out).validate()


def test_mixed_dtypes_refused(written, copy):
    with pytest.raises(ValueError, match="dtype float16 differs"):
        MappedDataset([written["fp32"], written["fp16"]])
    out = copy("fp32")                                           # one fp16 shard in an fp32 output
    shutil.copyfile(_arrow_shard(written["fp16"], 1), _arrow_shard(out, 1))
    with pytest.raises(DamagedOutput, match="halffloat|bytes, the manifest records"):   # its record, then its type
        MappedDataset(out)
    with pytest.raises(DamagedOutput, match=_arrow_shard(out, 1)):
        list(ElmoOutput(out).sentences("arrow"))


@pytest.mark.parametrize("escape", ["parent", "absolute"])
def test_manifest_paths_outside_the_output_refused(copy, tmp_path, escape):
    out, other = copy("fp32"), copy("fp16")                      # a real output beside it, to be read instead
    m = _manifest(out)
    target = _manifest(other)["shards"][0]["arrow"]
    m["shards"][0]["arrow"] = f"../fp16/{target}" if escape == "parent" else os.path.join(other, target)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    with pytest.raises(DamagedOutput, match="not a relative path inside the output"):
        ElmoOutput(out)
    with pytest.raises(DamagedOutput, match="manifest.json: shard 0 arrow"):
        MappedDataset(out)


def test_hdf5_shard_declaring_more_rows_than_the_manifest_refused(copy):
    out = copy("fp32")
    m = _manifest(out)
    shard = os.path.join(out, m["shards"][0]["hdf5"])
    with h5py.File(shard, "r") as h:
        keys = {k: (h[k].shape, h[k].dtype) for k in h.keys()}
    with h5py.File(shard, "w") as h:                             # a small file declaring 1M rows, never written
        for k, (shape, dtype) in keys.items():
            h.create_dataset(k, shape=(shape[0], 1_000_000, shape[2]), dtype=dtype)
    assert os.path.getsize(shard) < 100_000
    with pytest.raises(DamagedOutput, match="bytes, the manifest records"):       # its recorded size
        list(ElmoOutput(out).sentences("hdf5"))
    m = _manifest(out)
    del m["files"], m["kernel_path"]                             # an output of a version that recorded none
    json.dump(m, open(os.path.join(out, "manifest.json"), "w"))
    with pytest.raises(DamagedOutput, match="declares 1000000 rows"):
        list(ElmoOutput(out).sentences("hdf5"))


@pytest.mark.parametrize("field,value,says", [
    ("layers", 0, "not a list of distinct layer names"),
    ("layers", ["layer_0", "layer_0", "layer_2"], "not a list of distinct layer names"),
    ("layers", ["id", "layer_1", "layer_2"], "not a list of distinct layer names"),     # a metadata column
    ("layers", [0, "layer_1", "layer_2"], "not a list of distinct layer names"),
    ("layer_dims", 1.5, "not a width"),
    ("layer_dims", {"layer_0": 32, "layer_1": 10 ** 18, "layer_2": 32}, "not a width"),
    ("layer_dims", {"layer_0": 32, "layer_1": 32}, "not a width"),                       # layer_2 has none
    ("layer_dims", {"layer_0": 32, "layer_1": 24, "layer_2": 32}, "neither the widest nor half"),
    ("formats", -1, "not a list of format names"),
    ("parquet_layout", [], "neither sentence nor token"),
])
def test_manifest_header_fields_of_the_wrong_kind_refused(copy, field, value, says):
    """Each manifest field the readers size or name things by is checked on open: one DamagedOutput naming
    manifest.json, from ElmoOutput and MappedDataset alike (not a TypeError, KeyError or OverflowError later)."""
    out = copy("fp32")
    m = _manifest(out)
    m[field] = value
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    for read in (lambda: ElmoOutput(out), lambda: MappedDataset(out)):
        with pytest.raises(DamagedOutput, match=f"manifest.json: {field} .*{says}"):
            read()


@pytest.mark.parametrize("value", [True, -1, "3", 2.0, None])
def test_manifest_shard_counts_of_the_wrong_kind_refused(copy, value):
    """A shard entry's sentence count that is no count (a JSON true is no 1) is refused on open, naming
    manifest.json's shard."""
    out = copy("fp32")
    m = _manifest(out)
    m["shards"][0]["sentences"] = value
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    for read in (lambda: ElmoOutput(out), lambda: MappedDataset(out)):
        with pytest.raises(DamagedOutput, match="manifest.json: shard 0: not a shard entry"):
            read()


@pytest.mark.parametrize("damage", ["column", "width", "dtype", "not parquet"])
def test_parquet_shard_not_matching_its_manifest_refused(copy, damage):
    """A Parquet shard without a layer column, with another width or dtype, or not Parquet at all: one
    DamagedOutput naming the shard from every reader of it (the metadata of an HDF5 twin too)."""
    import pyarrow.parquet as pq
    from elmo_pipeline.downstream.readers import ElmoDataset
    out = copy("fp32")
    shard = os.path.join(out, _manifest(out)["shards"][0]["parquet"])
    t = pq.read_table(shard)
    if damage == "column":
        t = t.drop_columns(["layer_1"])
    elif damage in ("width", "dtype"):
        col = t.column("layer_1").combine_chunks()
        rows = col.flatten()                                     # (tokens, D) fixed-size lists
        width = rows.type.list_size
        values = rows.flatten().to_numpy()
        if damage == "width":
            flat = pa.FixedSizeListArray.from_arrays(pa.array(values[: len(values) // 2 * 2]), width // 2)
            values_rows = pa.ListArray.from_arrays(pa.array((col.offsets.to_numpy() * 2).astype(np.int32)), flat)
        else:
            flat = pa.FixedSizeListArray.from_arrays(pa.array(values.astype(np.float16)), width)
            values_rows = pa.ListArray.from_arrays(col.offsets, flat)
        t = t.set_column(t.schema.get_field_index("layer_1"), "layer_1", values_rows)
    if damage == "not parquet":
        with open(shard, "wb") as f:
            f.write(b"PAR1" + b"\x00" * 100)
    else:
        pq.write_table(t, shard)
    for read in (lambda: list(ElmoOutput(out).sentences("parquet")), lambda: ElmoDataset(out, fmt="parquet")[0],
                 lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput) as e:
            read()
        assert shard in str(e.value) and "\n" not in str(e.value)


def _rewrite_hdf5(shard: str, change) -> None:
    """The shard written anew with its datasets as they were, change(h5py file) applied."""
    with h5py.File(shard, "r") as h:
        data = {k: h[k][...] for k in h.keys()}
    with h5py.File(shard, "w") as h:
        for k, v in data.items():
            h.create_dataset(k, data=v)
        change(h)


def _broken_signature(shard: str) -> None:
    """The shard's first symbol-table node or B-tree signature overwritten (damaged group metadata)."""
    with open(shard, "r+b") as f:
        data = f.read()
        at = min(i for i in (data.find(b"SNOD"), data.find(b"TREE")) if i >= 0)
        f.seek(at)
        f.write(b"XXXX")


@pytest.mark.parametrize("damage", ["signature", "name", "datatype", "not hdf5"])
def test_hdf5_shard_with_damaged_metadata_refused(copy, damage):
    """What h5py finds in a damaged shard (a RuntimeError, a bytes name, a named datatype where a dataset was, an
    OSError) is one DamagedOutput naming the shard, from every reader of it."""
    from elmo_pipeline.downstream.readers import ElmoDataset
    out = copy("fp32")
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])
    if damage == "signature":
        _broken_signature(shard)
    elif damage == "name":                                        # one more dataset, named by bytes not UTF-8
        _rewrite_hdf5(shard, lambda h: h.create_dataset(b"\xff\xfe", data=np.zeros((3, 1, 32), np.float32)))
        with h5py.File(shard, "r") as h:
            assert any(isinstance(k, bytes) for k in h.keys())
    elif damage == "datatype":                                    # a sentence's dataset replaced by a datatype
        def swap(h):
            k = sorted(h.keys())[0]
            del h[k]
            h[k] = np.dtype("float32")
        _rewrite_hdf5(shard, swap)
    else:
        with open(shard, "wb") as f:
            f.write(b"\x00" * 4096)
    for read in (lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: ElmoDataset(out, fmt="hdf5")[0],
                 lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput) as e:
            read()
        assert shard in str(e.value) and "\n" not in str(e.value)


def test_full_validation_of_a_sound_output(written):
    for name in ("fp32", "fp16"):
        ElmoOutput(written[name]).validate()


def _as_earlier_version(out: str) -> None:
    """The manifest without its file records (an output of a version that recorded none: read, sizes unchecked),
    so a same-size or resized shard reaches the readers' own checks."""
    m = _manifest(out)
    m.pop("files"), m.pop("kernel_path")
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)


def test_an_arrow_shard_whose_footer_fails_verification_is_damaged_not_an_oserror(copy):
    """pyarrow raises OSError, not an ArrowException, for a footer that fails its flatbuffer verification (read
    with size checks only: by default its SHA-256 refuses it first)."""
    out = copy("fp32")
    shard = _arrow_shard(out)
    data = bytearray(open(shard, "rb").read())
    data[-12] ^= 0xFF                                   # inside the footer; the same size
    open(shard, "wb").write(bytes(data))
    for read in (lambda: list(ElmoOutput(out, verify="size").sentences("arrow")),
                 lambda: MappedDataset(ElmoOutput(out, verify="size"))[0]):
        with pytest.raises(DamagedOutput, match="not a readable Arrow IPC file"):
            read()
    for read in (lambda: list(ElmoOutput(out).sentences("arrow")), lambda: MappedDataset(out)[0]):
        with pytest.raises(DamagedOutput, match=re.escape("not the file the manifest records (its SHA-256 differs)")):
            read()


@pytest.mark.parametrize("where", ["external file", "external link"])
def test_an_hdf5_dataset_whose_data_is_outside_its_file_is_refused(copy, tmp_path, where):
    """A dataset stored in another file (external storage: a FIFO there would block every reader) or an external
    link to another HDF5 file: refused, never read as the sentence's vectors."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])
    elsewhere = str(tmp_path / "elsewhere.bin")

    def swap(h):
        k = sorted(h.keys())[0]
        shape, dtype = h[k].shape, h[k].dtype
        del h[k]
        if where == "external file":
            open(elsewhere, "wb").write(np.full(shape, 7, dtype).tobytes())
            h.create_dataset(k, shape, dtype, external=[(elsewhere, 0, int(np.prod(shape)) * dtype.itemsize)])
        else:
            with h5py.File(elsewhere, "w") as other:
                other.create_dataset("v", data=np.full(shape, 7, dtype))
            h[k] = h5py.ExternalLink(elsewhere, "v")
    _rewrite_hdf5(shard, swap)
    with pytest.raises(DamagedOutput, match="outside the file|is a link"):
        list(ElmoOutput(out).sentences("hdf5"))


def test_an_hdf5_dataset_stored_in_chunks_larger_than_itself_is_refused_unread(copy):
    """A dataset of its declared shape whose chunks are far larger (maxshape lets HDF5 take chunks up to 4 GiB; a
    read inflates whole chunks): refused before it is read; the writer's own datasets pass."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])

    def swap(h):
        k = sorted(h.keys())[0]
        data = h[k][...]
        del h[k]
        h.create_dataset(k, data=data, maxshape=(data.shape[0], None, data.shape[2]),
                         chunks=(data.shape[0], 200_000, data.shape[2]), compression="gzip")
    assert len(list(ElmoOutput(out).sentences("hdf5"))) > 0
    _rewrite_hdf5(shard, swap)
    with pytest.raises(DamagedOutput, match=r"is stored in chunks \(\d+, 200000, \d+\), larger than its shape"):
        list(ElmoOutput(out).sentences("hdf5"))


def test_a_parquet_shard_with_fewer_sentences_or_more_values_than_its_manifest_is_refused(copy):
    """Checked from the footer before a page is read: a shard short of a sentence was read short, without an error,
    and one whose rows hold more vectors than the manifest's tokens was decoded whole."""
    import pyarrow.parquet as pq
    from elmo_pipeline.downstream.shard_checks import check_parquet_counts
    from elmo_pipeline.downstream.tables import to_arrow_table
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["parquet"])
    t = pq.read_table(shard)
    pq.write_table(t.slice(1), shard)
    for read in (lambda: list(ElmoOutput(out).sentences("parquet")), lambda: list(ElmoOutput(out).sentences("hdf5")),
                 lambda: to_arrow_table(out)):
        with pytest.raises(DamagedOutput, match=r"rows, the manifest says \d+ sentences"):
            read()
    n, tokens = t.num_rows, sum(len(x) for x in t.column("tokens").to_pylist())
    doubled = t.set_column(t.schema.get_field_index("tokens"), "tokens",
                           pa.array([x + x for x in t.column("tokens").to_pylist()]))
    pq.write_table(doubled, shard)
    dims = {"layer_0": t.column("layer_0").type.value_type.list_size}
    with pytest.raises(DamagedOutput, match="column tokens holds"):
        check_parquet_counts(pq.ParquetFile(shard).metadata, shard, n, tokens, dims, "sentence")


@pytest.mark.parametrize("edit", ["outside", "unrecorded", "not an entry"])
def test_a_resumed_finalize_follows_no_manifest_listing_files_it_did_not_write(copy, tiny_model_files, edit):
    """A finished output with _SUCCESS gone and its manifest edited: a shard path outside the output, a listed file
    the manifest records nothing for, a dead-letter entry that is no entry. The rerun starts over (before: it
    'finished the interrupted finalize' of a manifest readers refuse, or exited 70) and the output reads back."""
    out = copy("fp32")
    os.remove(os.path.join(out, "_SUCCESS"))
    m = _manifest(out)
    if edit == "outside":
        m["shards"].append({**m["shards"][0], "parquet": "../fp32/" + m["shards"][0]["parquet"]})
    elif edit == "unrecorded":
        m["files"].pop(m["shards"][0]["parquet"])
    else:
        m["dead_letter_files"] = [5]
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    run_pipeline(tiny_model_files, _source(out), out, *COMMON, "--format", "parquet,hdf5,arrow")
    ElmoOutput(out).validate()
    assert len(list(ElmoOutput(out).sentences("parquet"))) == len(TEXT)


def _source(out: str) -> str:
    return _manifest(out)["inputs"][0]


def test_a_cached_copy_of_a_remote_shard_is_the_file_its_manifest_records(written, tmp_path):
    """A remote (memory://) output read through local copies, then a shard rewritten with its record (as a rerun
    with --overwrite writes it, under the same run key): the next reader copies it again and reads the new bytes
    (before: the cached copy of the same size was served); a copy that is not the recorded file is refused."""
    import hashlib

    import fsspec
    fs, src = fsspec.filesystem("memory"), written["fp32"]
    for d, _, names in os.walk(src):
        for name in names:
            fs.pipe(f"/cached/{os.path.relpath(os.path.join(d, name), src)}", open(os.path.join(d, name), "rb").read())
    cache = str(tmp_path / "cache")
    before = MappedDataset("memory://cached", cache_dir=cache)[0]["layers"]
    m = json.loads(fs.cat_file("/cached/manifest.json"))
    rel = m["shards"][0]["arrow"]
    local = str(tmp_path / "shard.arrow")
    open(local, "wb").write(fs.cat_file(f"/cached/{rel}"))
    _poke(local, _file_offset(local, lambda b: b.column("layer_2").flatten().buffers()[1]), 0x41)
    data = open(local, "rb").read()
    fs.pipe(f"/cached/{rel}", data)
    m["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    fs.pipe("/cached/manifest.json", json.dumps(m).encode())
    after = MappedDataset("memory://cached", cache_dir=cache)[0]["layers"]
    assert not np.array_equal(before, after)
    m["files"][rel]["sha256"] = "0" * 64                              # a record the file does not match
    fs.pipe("/cached/manifest.json", json.dumps(m).encode())
    with pytest.raises(DamagedOutput, match="not the file the manifest records"):
        MappedDataset("memory://cached", cache_dir=str(tmp_path / "other"))[0]
    fs.rm("/cached", recursive=True)


def test_a_remote_shard_replaced_by_a_huge_object_is_never_copied_whole(written, tmp_path, monkeypatch):
    """A remote shard replaced (after the output was opened) by an object far larger than its record is refused as
    it is copied into the shard cache having read at most its recorded size + 1: it never fills the local disk, and
    nothing is left in the cache."""
    from elmo_pipeline.downstream.output import ElmoOutput as Out
    from elmo_pipeline.downstream.shard_cache import ShardCache
    url = _in_memory(written["fp32"], "huge")
    out, cache = Out(url), str(tmp_path / "cache")
    path = out.shard_path(0, "arrow")
    record = out.files[posixpath.relpath(path, out.root)]
    out.fs.pipe(path, b"\0" * (record["bytes"] + (64 << 20)))
    read, real_open = [], type(out.fs).open

    def counting_open(self, p, mode="rb", **kw):
        f = real_open(self, p, mode, **kw)
        real_read = f.read
        f.read = lambda n=-1: read.append(len(chunk := real_read(n))) or chunk
        return f
    monkeypatch.setattr(type(out.fs), "open", counting_open)
    with pytest.raises(DamagedOutput, match="not the file the manifest records"):
        ShardCache(cache).local(out, path)
    assert sum(read) <= record["bytes"] + 1
    assert not [f for _, _, fs in os.walk(cache) for f in fs]
    monkeypatch.undo()
    out.fs.rm("/huge", recursive=True)


def test_a_storage_error_reading_a_remote_arrow_shard_is_not_a_damaged_output():
    """downstream/arrow_shards.py read_arrow_shard: the store's failure propagates as itself (a status to retry),
    only bytes that do not parse are a DamagedOutput."""
    from elmo_pipeline.downstream.arrow_shards import read_arrow_shard

    class Failing:
        protocol = "memory"

        def cat_file(self, path):
            raise ConnectionResetError(104, "Connection reset by peer")
    with pytest.raises(ConnectionResetError):
        read_arrow_shard(Failing(), "/o/arrow/part-00000-of-00001.arrow")


def test_to_arrow_table_refuses_a_column_it_does_not_have(written):
    from elmo_pipeline.downstream.tables import to_arrow_table
    assert to_arrow_table(written["fp32"], columns=["id"]).column_names == ["id"]
    with pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        to_arrow_table(written["fp32"], columns=["id", "nope"])


def _shift_first_row(shard: str) -> None:
    """Each layer list of row 0 one vector longer and of row 1 one shorter: the footer's totals unchanged."""
    import pyarrow.parquet as pq
    t = pq.read_table(shard)
    cols = {}
    for name in t.column_names:
        col = t.column(name).combine_chunks()
        if name.startswith("layer_"):
            offsets = col.offsets.to_numpy().copy()
            offsets[1] += 1
            col = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), col.values)
        cols[name] = col
    pq.write_table(pa.table(cols, schema=t.schema), shard)


def test_a_parquet_row_whose_vectors_are_not_its_tokens_is_refused(copy):
    """Row 0's layer lists a vector longer, row 1's one shorter (the same totals): every reader returned sentence 0
    with a vector too many and sentence 1 starting with sentence 0's last, and validate() passed."""
    from elmo_pipeline.downstream.tables import to_arrow_table
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["parquet"])
    _shift_first_row(shard)
    for read in (lambda: list(ElmoOutput(out).sentences("parquet")), lambda: ElmoOutput(out).validate(),
                 lambda: to_arrow_table(out), lambda: to_arrow_table(out, columns=["id", "layer_2"])):
        with pytest.raises(DamagedOutput, match=r"row 0 holds \d+ vectors in column layer_\d for its \d+ tokens") as e:
            read()
        assert shard in str(e.value)
    assert to_arrow_table(out, columns=["id", "tokens"]).num_rows == len(TEXT)    # no layer asked: nothing paired


def test_an_hdf5_dataset_whose_rows_are_not_its_parquet_twins_tokens_is_refused(copy):
    """Sentence 0's dataset a row longer, sentence 1's a row shorter (the manifest's tokens unchanged): its vectors
    were paired with its Parquet twin's tokens as they came."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])

    def shift(h):
        a, b = sorted(h.keys())[:2]
        x, y = h[a][...], h[b][...]
        del h[a], h[b]
        h.create_dataset(a, data=np.concatenate([x, y[:, :1]], axis=1))
        h.create_dataset(b, data=y[:, 1:])
    _rewrite_hdf5(shard, shift)
    for read in (lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput, match=r"holds \d+ vectors for the \d+ tokens of its Parquet twin") as e:
            read()
        assert shard in str(e.value)


def _in_memory(src: str, name: str) -> str:
    """A copy of the output `src` on fsspec's memory:// (a remote store to MappedDataset: shards go to its cache)."""
    import fsspec
    fs = fsspec.filesystem("memory")
    for d, _, names in os.walk(src):
        for n in names:
            fs.pipe(f"/{name}/{os.path.relpath(os.path.join(d, n), src)}", open(os.path.join(d, n), "rb").read())
    return f"memory://{name}"


def test_a_copy_found_in_the_shard_cache_is_used_only_as_the_recorded_file(written, tmp_path):
    """A file already at a shard's cache path (its name follows from the manifest), of the recorded size but other
    bytes, was served as the shard (wrong vectors, no error); prefetch took it as copied. Now it is checked against
    the manifest's SHA-256: refused naming it and left as it is; the recorded bytes found there are used."""
    from elmo_pipeline.downstream.output import ElmoOutput as Out
    from elmo_pipeline.downstream.shard_cache import ShardCache
    url = _in_memory(written["fp32"], "planted")
    out, cache = Out(url), str(tmp_path / "cache")
    path = out.shard_path(0, "arrow")
    local = ShardCache(cache).local_path(out, path)
    os.makedirs(os.path.dirname(local))
    shutil.copyfile(_arrow_shard(written["fp32"]), local)
    _poke(local, _file_offset(local, lambda b: b.column("layer_2").flatten().buffers()[1]), 0x41)
    planted = open(local, "rb").read()
    c = ShardCache(cache)
    c.prefetch(out, path)
    assert local in c._in_flight()                         # checked in the background, not taken as done
    for read in (lambda: c.local(out, path), lambda: MappedDataset(url, cache_dir=cache)[0]):
        with pytest.raises(DamagedOutput, match="in the shard cache but not .* as its manifest records it") as e:
            read()
        assert str(e.value).startswith(local)
    assert open(local, "rb").read() == planted
    shutil.copyfile(_arrow_shard(written["fp32"]), local)    # the recorded bytes (another process's copy): used
    assert np.array_equal(MappedDataset(url, cache_dir=cache)[0]["layers"], MappedDataset(written["fp32"])[0]["layers"])
    out.fs.rm("/planted", recursive=True)


def test_the_default_shard_cache_is_a_folder_only_this_user_writes(written, tmp_path, monkeypatch):
    """The default cache was <tmp>/elmo-mapped, shared by every user of /tmp: now <tmp>/elmo-mapped-<uid>, made
    0o700, refused when it is a link or others may write it."""
    import tempfile

    from elmo_pipeline.downstream.output import ElmoOutput as Out
    from elmo_pipeline.downstream.shard_cache import ShardCache
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = _in_memory(written["fp32"], "private")
    out = Out(url)
    root = str(tmp_path / f"elmo-mapped-{os.getuid()}")
    assert ShardCache().local_path(out, out.shard_path(0, "arrow")).startswith(root + "/")
    assert os.stat(root).st_mode & 0o777 == 0o700
    os.chmod(root, 0o777)
    with pytest.raises(PermissionError, match="not a folder of this user's"):
        ShardCache().local_path(out, out.shard_path(0, "arrow"))
    os.rmdir(root)
    os.makedirs(tmp_path / "elsewhere", mode=0o700)
    os.symlink(tmp_path / "elsewhere", root)
    with pytest.raises(PermissionError, match="not a folder of this user's"):
        ShardCache().local_path(out, out.shard_path(0, "arrow"))
    out.fs.rm("/private", recursive=True)


def test_an_hdf5_dataset_stored_through_a_filter_is_refused_unread(copy):
    """A chunk of its dataset's shape whose deflate stream (deflate applied twice) inflates far past it: HDF5 grows
    the filter's buffer until the stream ends, so reading it allocated what the stream held. The writer uses no
    filter: any is refused before the dataset is read."""
    import zlib
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])

    def swap(h):
        k = sorted(h.keys())[0]
        shape = h[k].shape
        del h[k]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(shape)
        dcpl.set_deflate(9)
        dcpl.set_filter(h5py.h5z.FILTER_DEFLATE, h5py.h5z.FLAG_OPTIONAL, (9,))
        d = h5py.h5d.create(h.id, k.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple(shape), dcpl=dcpl)
        d.write_direct_chunk((0,) * len(shape), zlib.compress(zlib.compress(b"\0" * (64 << 20), 9), 9), 0)
    _rewrite_hdf5(shard, swap)
    assert os.path.getsize(shard) < 1 << 20
    for read in (lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput, match=r"is stored through filters \(compression\)") as e:
            read()
        assert shard in str(e.value)


def _parquet_with(shard: str, change) -> None:
    """The Parquet shard written anew (zstd) with change(name, column) for each column."""
    import pyarrow.parquet as pq
    t = pq.read_table(shard)
    cols = {n: change(n, t.column(n).combine_chunks()) for n in t.column_names}
    pq.write_table(pa.table(cols, schema=t.schema), shard, compression="zstd", compression_level=19)


def test_a_parquet_text_page_inflating_past_the_manifests_records_is_refused_unread(copy):
    """A token of 16 MiB in a shard of a few KB (zstd), the counts as the manifest says: each reader decompressed
    it whole. Its pages' headers are checked first: 3 sentences of --max-record-bytes 1 MiB hold no more text."""
    from elmo_pipeline.downstream.tables import to_arrow_table
    out = copy("fp32")
    _as_earlier_version(out)
    m = _manifest(out)
    m["options"]["max_record_bytes"] = 1 << 20                  # as a run with --max-record-bytes 1048576
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    shard = os.path.join(out, _manifest(out)["shards"][0]["parquet"])

    def bomb(name, col):
        if name != "tokens":
            return col
        tokens = col.to_pylist()
        tokens[0][0] = "a" * (16 << 20)
        return pa.array(tokens, col.type)
    _parquet_with(shard, bomb)
    assert os.path.getsize(shard) < 1 << 20
    for read in (lambda: list(ElmoOutput(out).sentences("parquet")), lambda: list(ElmoOutput(out).sentences("hdf5")),
                 lambda: ElmoOutput(out).validate(), lambda: to_arrow_table(out, columns=["layer_1"])):
        with pytest.raises(DamagedOutput, match=r"column tokens\.list\.element's pages decompress to \d+ bytes of "
                                                r"text, more than 3 rows of --max-record-bytes 1048576") as e:
            read()
        assert shard in str(e.value)
    assert to_arrow_table(out, columns=["id"]).num_rows == len(TEXT)      # a column not read is not checked


def test_a_parquet_vector_page_declaring_more_bytes_than_its_values_is_refused_unread(copy):
    """A layer page's header declaring more bytes uncompressed than its floats hold (the allocation a decompressing
    reader makes): refused from the header, before the page is read."""
    import pyarrow.parquet as pq
    from elmo_pipeline.formats.parquet_pages import chunk_span, column_pages
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["parquet"])
    md = pq.ParquetFile(shard).metadata
    leaf = next(i for i in range(md.num_columns) if md.row_group(0).column(i).path_in_schema.startswith("layer_1."))
    start, length = chunk_span(md.row_group(0).column(leaf))
    with open(shard, "r+b") as f:
        [page] = column_pages(f, start, length)
        f.seek(start)
        head = f.read(page.header)
        old = _zigzag_varint(page.uncompressed)
        at = head.index(old)
        big = (1 << (7 * len(old) - 1)) - 1                 # the most the header's bytes can say
        new = _zigzag_varint(big)
        assert len(new) == len(old) and big > page.count * 12 + 1024
        f.seek(start + at)
        f.write(new)
    for read in (lambda: list(ElmoOutput(out).sentences("parquet")), lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput, match=r"a page of column layer_1\.list\.element\.list\.element decompresses "
                                                rf"to {big} bytes, more than its \d+ values hold") as e:
            read()
        assert shard in str(e.value)


def _zigzag_varint(n: int) -> bytes:
    n, out = n << 1, b""
    while True:
        if n < 0x80:
            return out + bytes([n])
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7


def test_an_arrow_shard_with_compressed_batches_is_refused_before_they_are_decompressed(copy):
    """An Arrow shard written with IPC body compression (zstd), its `token` column holding a 16 MiB string, in a
    file of a few KB: pyarrow decompressed every buffer on open. The writer compresses none: a batch or dictionary
    declaring compression is refused from its metadata, local (mapped) or remote (read whole)."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = _arrow_shard(out)
    b = pa.ipc.open_file(shard).get_batch(0)
    tokens = b.column("token").to_pylist()
    tokens[0] = "a" * (16 << 20)
    b = b.set_column(b.schema.get_field_index("token"), "token", pa.array(tokens, pa.string()))
    with pa.ipc.new_file(shard, b.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_batch(b)
    assert os.path.getsize(shard) < 1 << 20
    url = _in_memory(out, "compressed")
    for read in (lambda: list(ElmoOutput(out).sentences("arrow")), lambda: MappedDataset(out),
                 lambda: ElmoOutput(out).validate(), lambda: list(ElmoOutput(url).sentences("arrow"))):
        with pytest.raises(DamagedOutput, match=r"its batches are compressed \(IPC body compression\)") as e:
            read()
        assert str(e.value).endswith("the writer compresses none")
    ElmoOutput(url).fs.rm("/compressed", recursive=True)


def test_an_arrow_field_name_that_is_not_utf8_is_a_damaged_output(copy):
    """A byte of a field name in the IPC metadata flipped to 0xFF: each reader raised a bare UnicodeDecodeError
    naming neither the file nor the output."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = _arrow_shard(out)
    data = open(shard, "rb").read().replace(b"sentence_index", b"\xffentence_index")
    open(shard, "wb").write(data)
    url = _in_memory(out, "badname")
    for read in (lambda: list(ElmoOutput(out).sentences("arrow")), lambda: MappedDataset(out),
                 lambda: ElmoOutput(out).validate(), lambda: list(ElmoOutput(url).sentences("arrow"))):
        with pytest.raises(DamagedOutput, match="a field name is not UTF-8 text") as e:
            read()
        assert str(e.value).endswith(f"{os.path.relpath(shard, out)}: a field name is not UTF-8 text")
    ElmoOutput(url).fs.rm("/badname", recursive=True)


def test_an_hdf5_dataset_naming_a_sentence_its_parquet_twin_lacks_is_refused(copy):
    """A dataset renamed to another id (`#0` -> `#7`, the same length): it was read as that sentence, without tokens
    and with another sentence's vectors; each dataset must name one of its Parquet twin's sentences."""
    out = copy("fp32")
    _as_earlier_version(out)
    shard = os.path.join(out, _manifest(out)["shards"][0]["hdf5"])

    def rename(h):
        a = sorted(h.keys())[0]
        h.move(a, a[:-1] + "7")
    _rewrite_hdf5(shard, rename)
    for read in (lambda: list(ElmoOutput(out).sentences("hdf5")), lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput, match="names a sentence its Parquet twin does not hold"):
            read()


@pytest.mark.parametrize("damage", ["token renamed", "block at the end"])
def test_an_arrow_shard_with_a_damaged_schema_or_footer_is_a_damaged_output(copy, damage):
    """The `token` field renamed (validate() passed, readers raised KeyError), the record batch's block pointing at
    the end-of-stream marker (a bare EOFError): DamagedOutput naming the shard, on every read path."""
    import struct
    out = copy("fp32")
    _as_earlier_version(out)
    shard = _arrow_shard(out)
    data = bytearray(open(shard, "rb").read())
    if damage == "token renamed":
        data = bytearray(bytes(data).replace(b"\x05\x00\x00\x00token", b"\x05\x00\x00\x00tokeN"))   # schema, footer
    else:                               # the footer's record batch blocks (a vector: count, then 24-byte blocks)
        from elmo_pipeline.formats.arrow import _at, _field
        b = memoryview(data)
        end = len(data) - 10
        footer = end - struct.unpack_from("<i", data, end)[0]
        blocks = _at(b, _field(b, _at(b, footer), 3))
        assert struct.unpack_from("<I", data, blocks)[0] == 1 and data[footer - 8:footer] == b"\xff" * 4 + bytes(4)
        struct.pack_into("<q", data, blocks + 4, footer - 8)     # the end-of-stream marker before the footer
        del b
    open(shard, "wb").write(bytes(data))
    for read in (lambda: list(ElmoOutput(out).sentences("arrow")), lambda: MappedDataset(out),
                 lambda: ElmoOutput(out).validate()):
        with pytest.raises(DamagedOutput) as e:
            read()
        assert os.path.relpath(shard, out) in str(e.value)


def test_a_token_layout_output_of_long_sentences_under_a_small_max_record_bytes_reads_back(tmp_path, tiny_model_files):
    """The token layout repeats a sentence's id on each of its token rows: 2,000 tokens of one sentence hold more id
    text than 3 x --max-record-bytes 4096, which the page check allowed a sentence (it refused the run's own
    output); a row's text is bounded instead."""
    inp, out = tmp_path / "corpus_2024.txt", str(tmp_path / "out")
    inp.write_text(" ".join(["a"] * 2000) + "\n")
    run_pipeline(tiny_model_files, str(inp), out, *COMMON, "--format", "parquet", "--parquet-layout", "token",
                 "--max-record-bytes", "4096")
    o = ElmoOutput(out)
    o.validate()
    [record] = list(o.sentences())
    assert len(record["tokens"]) == 2000


def test_an_answer_cut_short_is_a_storage_failure_not_a_missing_manifest(written, monkeypatch):
    """A store (or a proxy) that cuts a file's bytes short with its length rewritten: the manifest read back was
    'no manifest.json (not a finished pipeline output)', which made a run take a finished output for foreign files
    (exit 2). Now a ConnectionError naming the file (retry later, exit 75); a recorded file read short too."""
    import fsspec
    from fsspec.implementations.memory import MemoryFile

    from elmo_pipeline.fsio import read_recorded
    from elmo_pipeline.pipeline.exits import classify
    url = _in_memory(written["fp32"], "cut")
    fs = fsspec.filesystem("memory")
    record = json.loads(fs.cat_file("/cut/manifest.json"))["files"]["metrics.prom"]
    real = MemoryFile.read
    monkeypatch.setattr(MemoryFile, "read", lambda self, n=-1: real(self, n)[:10])     # every answer: 10 bytes
    with pytest.raises(ConnectionError, match="manifest.json: 10 bytes came of the") as e:
        ElmoOutput(url)
    assert classify(e.value).status == 75
    with pytest.raises(ConnectionError, match="metrics.prom: 10 bytes came of the"):
        read_recorded(fs, "/cut/metrics.prom", record)
    monkeypatch.undo()
    fs.rm("/cut", recursive=True)


def _edit_manifest(out: str, edit) -> None:
    m = _manifest(out)
    edit(m)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("counts", ["kept", "updated"])
def test_a_manifest_naming_one_shard_file_twice_is_refused(copy, counts):
    """A manifest whose shard entries name one file twice (edited, its records consistent: the files are the recorded
    ones) gave every reader and validate() that shard's sentences twice and the other shard's none; with its counts
    kept, the sums differ from them too."""
    out = copy("fp32")

    def edit(m):
        m["shards"][1] = dict(m["shards"][0])
        if counts == "updated":
            m["counts"]["sentences_written"] = 2 * m["shards"][0]["sentences"]
            m["counts"]["tokens_written"] = 2 * m["shards"][0]["tokens"]
    _edit_manifest(out, edit)
    with pytest.raises(DamagedOutput, match="named by 2 shard entries"):
        ElmoOutput(out)
    with pytest.raises(DamagedOutput, match="named by 2 shard entries"):
        MappedDataset(out)


def test_shards_adding_up_to_other_than_the_manifests_counts_are_refused(copy):
    out = copy("fp32")
    _edit_manifest(out, lambda m: m["counts"].update(sentences_written=m["counts"]["sentences_written"] + 1))
    with pytest.raises(DamagedOutput, match="its counts say sentences_written"):
        ElmoOutput(out)


def test_a_shard_entry_dropped_from_the_manifest_is_found_by_validate(copy):
    """A shard entry removed (its counts taken off too): its files are still recorded, so validate() names the first
    (it passed, the output read short of that shard's sentences)."""
    out = copy("fp32")

    def edit(m):
        gone = m["shards"].pop(1)
        m["counts"]["sentences_written"] -= gone["sentences"]
        m["counts"]["tokens_written"] -= gone["tokens"]
    _edit_manifest(out, edit)
    with pytest.raises(DamagedOutput, match="named by no shard entry"):
        ElmoOutput(out).validate()


@pytest.mark.parametrize("url", ["http://user:s3cr3t-pw@127.0.0.1/out", "memory://nothere?token=s3cr3t-pw",
                                 "file:///nothere?X-Amz-Signature=s3cr3t-pw"])
def test_reader_errors_never_hold_a_urls_secret(url):
    """An output URL with a password, token or signature: the readers' exceptions show it redacted (before: the URL
    as given, in FileNotFoundError, ValueError and DamagedOutput messages a caller logs)."""
    with pytest.raises(OSError) as e:              # FileNotFoundError; ConnectionError where nothing answers
        ElmoOutput(url)
    assert "s3cr3t-pw" not in str(e.value) and "***" in str(e.value) and "manifest.json" in str(e.value)
    assert "s3cr3t-pw" not in str(DamagedOutput(f"{url}/arrow/part-0.arrow: not a regular file"))


def test_a_manifest_that_is_no_file_or_an_unreachable_store_is_said_as_such(tmp_path):
    """A FIFO at manifest.json: refused as no pipeline manifest, never opened (before: "no manifest.json", as if the
    folder held no output); an HTTP store refusing the connection: ConnectionError, retry later, its password
    masked (before: "no manifest.json", a missing output)."""
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(FileNotFoundError, match="its manifest.json is no pipeline manifest"):
        ElmoOutput(str(tmp_path))
    with pytest.raises(ConnectionError, match=re.escape("the store did not answer (a refused connection, a timeout "
                                                        "or a 5xx), retry later: http://***@127.0.0.1:9/out/manifest.json")) as e:
        ElmoOutput("http://user:s3cr3t-pw@127.0.0.1:9/out")
    assert "s3cr3t-pw" not in str(e.value)


def test_an_hdf5_dataset_declaring_more_than_its_file_stores_is_refused_unread(copy):
    """An HDF5-only output whose manifest (of a version that recorded no files) declares many tokens, and a dataset
    of that many rows with no storage behind it (HDF5 reads unwritten storage as its fill value): the read allocated
    the declared shape, 1.9 GB from a file of kilobytes. Refused before the read: a dataset's stored bytes must cover
    its shape, and all of them fit in the file."""
    out = copy("fp32")
    _as_earlier_version(out)
    m = _manifest(out)
    m["formats"] = ["hdf5"]
    for s in m["shards"]:
        s.pop("parquet"), s.pop("arrow")
    m["counts"]["tokens_written"] += 10 ** 7 - m["shards"][0]["tokens"]
    m["shards"][0]["tokens"] = 10 ** 7
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    shard = os.path.join(out, m["shards"][0]["hdf5"])
    assert len(list(ElmoOutput(out).sentences("hdf5"))) > 0

    def swap(h):
        k = sorted(h.keys())[0]
        shape, dtype = h[k].shape, h[k].dtype
        del h[k]
        h.create_dataset(k, (shape[0], 10 ** 7 - 100, shape[2]), dtype)      # no data written: no storage
    _rewrite_hdf5(shard, swap)
    assert os.path.getsize(shard) < 1 << 20
    with pytest.raises(DamagedOutput, match=r"stores \d+ of the \d+ bytes its shape declares"):
        list(ElmoOutput(out).sentences("hdf5"))
