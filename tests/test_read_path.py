"""The read path for training: --format arrow shards, downstream.mapped's MappedDataset and BucketBatchSampler,
over real pipeline outputs (tiny random biLM)."""
import glob
import json
import os
import re
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.downstream import ElmoDataset, ElmoOutput, batcher_pool, collate, mapped_stream
from elmo_pipeline.downstream.mapped import MappedDataset, unbatched
from elmo_pipeline.downstream.shard_checks import DamagedOutput
from elmo_pipeline.downstream.sampler import BucketBatchSampler
from elmo_pipeline.pipeline.cli import main as cli_main
from tests.pipeline_helpers import moto_s3, run_pipeline

TEXT = ["the first line", "and a second one with more words", "third", "a fourth line here", "five",
        "six is a longer line than most of the others", "seven", "eight nine ten"]
COMMON = ("--input-format", "lines", "--tokenizer", "whitespace", "--shard-sentences", "3")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_model_files):
    """Runs over the same lines: default formats, the three formats (fp32), the three formats (fp16), and a
    second partition (other lines) with arrow."""
    tmp = tmp_path_factory.mktemp("read_path")
    (tmp / "a.txt").write_text("\n".join(TEXT) + "\n")
    (tmp / "b.txt").write_text("\n".join(TEXT[:3]) + "\n")
    runs = {"default": (), "all": ("--format", "parquet,hdf5,arrow"),
            "fp16": ("--format", "parquet,arrow", "--dtype", "float16")}
    outs = {}
    for name, flags in runs.items():
        outs[name] = str(tmp / name)
        run_pipeline(tiny_model_files, str(tmp / "a.txt"), outs[name], *COMMON, *flags)
    outs["part2"] = str(tmp / "part2")
    run_pipeline(tiny_model_files, str(tmp / "b.txt"), outs["part2"], *COMMON, "--format", "arrow")
    return outs


def test_arrow_shards_listed_and_readable_by_pyarrow(outputs):
    m = json.load(open(os.path.join(outputs["all"], "manifest.json")))
    assert m["formats"] == ["parquet", "hdf5", "arrow"] and m["arrow_layout"] == "token-rows"
    assert all(s["arrow"].startswith("arrow/part-") for s in m["shards"]) and len(m["shards"]) == 3
    t = pa.ipc.open_file(os.path.join(outputs["all"], m["shards"][0]["arrow"])).read_all()
    assert t.schema.field("layer_1").type == pa.list_(pa.float32(), 2 * m["layer_dims"]["layer_0"])
    assert t.num_rows == m["shards"][0]["tokens"] and t.column("token").to_pylist()[:3] == ["the", "first", "line"]
    assert "arrow_layout" not in json.load(open(os.path.join(outputs["default"], "manifest.json")))


def test_arrow_records_equal_parquet_and_default_output_unchanged(outputs):
    default, all3 = ElmoOutput(outputs["default"]), ElmoOutput(outputs["all"])
    base = list(default.sentences("parquet"))
    for fmt in ("parquet", "hdf5", "arrow"):
        got = list(all3.sentences(fmt))
        assert [r["id"] for r in got] == [r["id"] for r in base]
        assert all(np.array_equal(a["layers"], b["layers"]) for a, b in zip(got, base))   # bit-identical fp32
        assert all(a["doc_id"] == b["doc_id"] and a["sentence_index"] == b["sentence_index"] for a, b in zip(got, base))
    assert [r["tokens"] for r in all3.sentences("arrow")] == [r["tokens"] for r in base]
    assert ElmoOutput(outputs["part2"]).default_format() == "arrow"


def test_mapped_dataset_records_batches_and_lookup(outputs):
    ref = ElmoDataset(outputs["all"])
    ds = MappedDataset(outputs["all"])
    assert len(ds) == len(ref) == len(TEXT) and ds.num_tokens == sum(len(t.split()) for t in TEXT)
    for i in range(len(ds)):
        a, b = ds[i], ref[i]
        assert (a["id"], a["doc_id"], a["sentence_index"], a["tokens"]) == (b["id"], b["doc_id"], b["sentence_index"], b["tokens"])
        assert np.array_equal(a["layers"], b["layers"])
        assert ds.position(b["id"]) == i and ds.by_id(b["id"])["id"] == b["id"]
    with pytest.raises(KeyError):
        ds.position("a.txt:99#0")
    views = ds.views(2)
    assert not views[0].flags.owndata and not views[0].flags.writeable    # a view of the mapped file
    order = [5, 0, 7, 3]
    got, want = ds.batch(order), collate([ref[i] for i in order])
    assert torch.equal(got["layers"], want["layers"]) and torch.equal(got["mask"], want["mask"])
    assert torch.equal(got["lengths"], want["lengths"]) and got["ids"] == want["ids"] and got["tokens"] == want["tokens"]
    assert ds.index_bytes() < 100 * len(ds)                      # bytes per sentence, not per float


def test_mapped_dataset_fp16_labels_and_partitions(outputs):
    fp16 = MappedDataset(outputs["fp16"], dtype=None, tokens=False)
    stored = list(ElmoOutput(outputs["fp16"]).iter_shard(0, "parquet", stacked=False))
    assert fp16.views(0)[1].dtype == np.float16 and np.array_equal(fp16.views(0)[1], stored[0]["stored"][1])
    b = fp16.batch([0, 1])
    assert b["layers"].dtype == torch.float16 and b["tokens"] == [None, None]
    assert MappedDataset(outputs["fp16"]).batch([0])["layers"].dtype == torch.float32
    both = MappedDataset([outputs["all"], outputs["part2"]], labels={"1": 1, "3": 0, "5": 1})
    assert len(both) == 5 and both.unlabelled == len(TEXT) + 3 - 5    # line labels: lines 1, 3 of both, 5 of a
    assert [r["label"] for r in both] == [1, 0, 1, 1, 0] and both.batch([0, 1])["label"].tolist() == [1, 0]
    assert both[3]["id"] == "b.txt:1#0" and both.position("b.txt:3#0") == 4
    tail = both.batch([-1, -2, 0])                                # positions from the end, labels of those
    assert tail["ids"] == [both[4]["id"], both[3]["id"], both[0]["id"]] and tail["label"].tolist() == [0, 1, 1]
    assert torch.equal(tail["layers"], both.batch([4, 3, 0])["layers"])
    for bad in ([0, 5], [-6]):
        with pytest.raises(IndexError, match=f"^position {bad[-1]} out of range \\(5 sentences\\)$"):
            both.batch(bad)
    assert both.batch([])["layers"].shape[0] == 0 and both.batch([])["ids"] == []


def test_fp16_records_converted_from_the_mapped_rows(outputs):
    """ds[p] and batches of a float16 output delivered as float32: the records and batches ElmoDataset gives;
    records converted by torch straight from the mapped file (a descriptor kept for the file's size check, none
    held), batches built from the maps and converted; a labelled dataset's too."""
    ref = ElmoDataset(outputs["fp16"])
    for labels in (None, {"2": 1, "4": 0}):
        ds = MappedDataset(outputs["fp16"], labels=labels)
        keep = [i for i in range(len(ref)) if labels is None or ref[i]["id"].split(":")[1].split("#")[0] in labels]
        for j, i in enumerate(keep):
            r = ds[j]
            assert r["layers"].dtype == np.float32 and r["layers"].flags.c_contiguous and r["layers"].flags.writeable
            assert np.array_equal(r["layers"], ref[i]["layers"]) and r["id"] == ref[i]["id"]
        assert not ds.files._busy
        order = list(range(len(ds)))[::-1]
        want = collate([ref[keep[j]] for j in order])
        for got in (ds.batch(order), next(iter(ds.batches([order], reuse=True)))):
            assert torch.equal(got["layers"], want["layers"]) and torch.equal(got["mask"], want["mask"])
        assert len(ds) == len(keep) > 0 and ds.files._open and not ds.files._busy



@pytest.mark.parametrize("dtype", [None, "float32"])
def test_batches_of_their_own_reuse_only_dropped_buffers(outputs, dtype):
    """batch() builds in kept buffers once nothing holds them: a batch held (the tensor, a view, its numpy
    array) keeps its values while later batches are built, and a dropped one's memory is built in again."""
    ref = ElmoDataset(outputs["fp16"])
    ds = MappedDataset(outputs["fp16"], dtype=dtype, tokens=False)
    orders = [[5, 0, 7, 3], [1, 2], [6, 4, 0], [7], [3, 5]]
    want = [collate([ref[i] for i in o])["layers"].to(getattr(torch, dtype or "float16")) for o in orders]
    held = [ds.batch(orders[0])["layers"], ds.batch(orders[1])["layers"][1:], ds.batch(orders[2])["layers"].numpy()]
    for o, w in zip(orders[3:], want[3:]):
        assert torch.equal(ds.batch(o)["layers"], w)
    assert torch.equal(held[0], want[0]) and torch.equal(held[1], want[1][1:])
    assert np.array_equal(held[2], want[2].numpy())
    del held
    kept = {b.untyped_storage().data_ptr() for b in ds.pool.of_thread(False)._pool}
    assert {ds.batch(o)["layers"].untyped_storage().data_ptr() for o in orders * 2} <= kept
    epoch = [b["layers"].clone() for b in ds.batches(orders)]       # batches(): batch()'s buffers, epoch to epoch
    assert all(torch.equal(b, w) for b, w in zip(epoch, want))
    assert next(iter(ds.batches(orders)))["layers"].untyped_storage().data_ptr() in kept


def test_reused_batches_keep_their_buffers_from_call_to_call(outputs):
    """batches(reuse=True) gives its buffers back to the dataset when the iteration ends: the next call builds in
    them (no new allocation to fault in); two iterations at once never share one."""
    ref = ElmoDataset(outputs["fp16"])
    ds = MappedDataset(outputs["fp16"], dtype=None, tokens=False)
    orders = [[5, 0, 7, 3], [1, 2], [6, 4, 0]]
    want = [collate([ref[i] for i in o])["layers"].half() for o in orders]
    first = {b["layers"].untyped_storage().data_ptr() for b in ds.batches(orders, reuse=True)}
    kept = {b._bufs["layers"].data_ptr() for b in ds.pool.free(False)}
    assert first == kept
    for b, w in zip(ds.batches(orders, reuse=True), want):
        assert torch.equal(b["layers"], w) and b["layers"].untyped_storage().data_ptr() in kept
    one, two = ds.batches(orders, reuse=True), ds.batches(orders[::-1], reuse=True)
    for x, y, wx, wy in zip(one, two, want, want[::-1]):
        assert torch.equal(x["layers"], wx) and torch.equal(y["layers"], wy)
    two.close()                                                      # the one zip did not run to its end
    assert len(ds.pool.free(False)) == 2


@pytest.mark.parametrize("name,dtype", [("fp16", "float32"), ("all", "float16")])
def test_converted_batches_equal_the_converted_records(outputs, monkeypatch, name, dtype):
    """A batch delivered in another dtype than stored (fp16 -> float32, float32 -> fp16), by one thread and
    split between two, equals ElmoDataset's records padded by collate and converted by torch."""
    monkeypatch.setattr(batcher_pool, "SPLIT_BYTES", 0)
    ref = ElmoDataset(outputs[name])
    order = [3, 0, 6, 1, 7, 2]
    want = collate([ref[i] for i in order])
    for threads in (1, 2):
        got = MappedDataset(outputs[name], dtype=dtype, tokens=False, threads=threads).batch(order)
        assert got["layers"].dtype == getattr(torch, dtype) and torch.equal(got["mask"], want["mask"])
        assert torch.equal(got["layers"], want["layers"].to(getattr(torch, dtype)))


def test_batch_over_more_shards_than_files_kept_open(outputs, monkeypatch):
    """A batch whose sentences lie in more shards than the open files kept (_FDS) reads each from its own
    shard: no descriptor is closed (and its number reused for another shard) before the batch is read."""
    from elmo_pipeline.downstream import mapped
    monkeypatch.setattr(mapped, "_FDS", 2)
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False)
    ref = ElmoDataset([outputs["all"], outputs["part2"]])
    assert len(ds.units) > 3
    for order in ([0, 3, 6, 8, 10], [10, 8, 6, 3, 0, 9, 4]):
        assert torch.equal(ds.batch(order)["layers"], collate([ref[i] for i in order])["layers"])
        assert len(ds.files._open) <= 2 and not ds.files._busy            # closed down to _FDS after the batch
    assert np.array_equal(ds[9]["layers"], ref[9]["layers"]) and len(ds.files._open) <= 2


def test_reads_from_several_threads_at_once(outputs, monkeypatch):
    """Batches (read by two threads each), records and a read-ahead iterator of one dataset used from three
    threads at once, two descriptors kept: every value as ElmoDataset's (a descriptor is never closed, its
    number reused for another shard, while a read holds it)."""
    import threading
    from elmo_pipeline.downstream import mapped
    monkeypatch.setattr(mapped, "_FDS", 2)
    monkeypatch.setattr(batcher_pool, "SPLIT_BYTES", 0)
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False, dtype=None)
    ref = ElmoDataset([outputs["all"], outputs["part2"]])
    want = {i: ref[i]["layers"] for i in range(len(ref))}
    orders = [list(np.random.default_rng(s).permutation(len(ds))[:5]) for s in range(30)]
    errors = []

    def check(fn) -> None:
        try:
            fn()
        except Exception as e:                                           # noqa: BLE001 - reported below
            errors.append(e)

    def batches() -> None:
        for order in orders:
            got = ds.batch(order)["layers"].float()
            for j, i in enumerate(order):
                assert np.array_equal(got[j, :, : want[i].shape[1]].numpy(), want[i])

    def records() -> None:
        for order in orders:
            for i in order:
                assert np.array_equal(ds[int(i)]["layers"], want[i])

    def ahead() -> None:
        for order, b in zip(orders, ds.batches(orders, ahead=2)):
            assert np.array_equal(b["layers"][0, :, : want[order[0]].shape[1]].float().numpy(), want[order[0]])
    threads = [threading.Thread(target=check, args=(f,)) for f in (batches, records, ahead)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(ds.files._open) <= 2 and not ds.files._busy


def test_two_read_threads_give_the_one_thread_batch(outputs, monkeypatch, tmp_path):
    """A batch split between the caller and the helper thread equals the one read by one thread, in the stored
    dtype and converted, every time (read 50 times: both threads write their scratch at once, so regions that
    overlap show as batches that differ); a shard cut short after the index was built fails the batch, the stream,
    a record and its views with the file named, never a SIGBUS (the helper's error raised in the caller; a
    converted batch read by one thread too); records of the other shards still read."""
    import shutil
    monkeypatch.setattr(batcher_pool, "SPLIT_BYTES", 0)
    for name in ("all", "fp16"):
        for dtype in (None, "float32"):
            one = MappedDataset(outputs[name], tokens=False, dtype=dtype, threads=1)
            two = MappedDataset(outputs[name], tokens=False, dtype=dtype, threads=2)
            order = list(range(len(one)))[::-1]
            a = one.batch(order)
            for _ in range(50):
                b = two.batch(order)
                assert torch.equal(a["layers"], b["layers"]) and torch.equal(a["mask"], b["mask"]), (name, dtype)
    out = tmp_path / "cut"
    shutil.copytree(outputs["all"], out)
    ds = MappedDataset(str(out), tokens=False, dtype=None)
    converted = MappedDataset(str(out), tokens=False, dtype="float16", threads=1)
    shard = os.path.join(str(out), ds.outputs[0].shards[0]["arrow"])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    for d in (ds, converted):
        with pytest.raises(DamagedOutput, match=f"^{re.escape(shard)}: file ends before byte"):
            d.batch(list(range(len(d)))[::-1])
    with pytest.raises(DamagedOutput, match=f"^{re.escape(shard)}: file ends before byte"):
        list(ds.stream())
    last = len(ds) - 1                                     # in the last shard, not cut
    assert ds.index.unit(last)[0] != 0 and ds.index.unit(0)[0] == 0
    for read in (lambda p: ds[p], ds.views, lambda p: converted[p], lambda p: ds.by_id(ds.index.meta(p)["id"])):
        with pytest.raises(DamagedOutput, match=f"^{re.escape(shard)}: file ends before byte"):
            read(0)
        read(last)


def test_a_shard_replaced_after_opening_is_refused_or_read_as_indexed(outputs, tmp_path):
    """A shard file replaced (renamed over) after the index was built: batches and the stream, which open it by
    its path, refuse it with DamagedOutput naming it (its rows are not where the index says); records read the
    mapped file the index was built from, so their values are the indexed ones; a copy that maps the shards again
    (unpickled) refuses it too; records still read the indexed file once the shard's path is removed."""
    import shutil
    out = tmp_path / "replaced"
    shutil.copytree(outputs["all"], out)
    ds = MappedDataset(str(out), tokens=False, dtype=None)
    shards = [os.path.join(str(out), s["arrow"]) for s in ds.outputs[0].shards]
    shutil.copy(shards[1], str(out / "other.arrow"))
    os.replace(str(out / "other.arrow"), shards[0])
    with pytest.raises(DamagedOutput, match=f"^{re.escape(shards[0])}: replaced since the dataset was opened"):
        ds.batch(list(range(len(ds))))
    with pytest.raises(DamagedOutput, match=f"^{re.escape(shards[0])}: replaced since the dataset was opened"):
        list(ds.stream())
    ref = ElmoDataset(outputs["all"])
    assert all(np.array_equal(ds[i]["layers"], ref[i]["layers"]) for i in range(len(ds)))
    assert not ds.files._busy
    import pickle
    copy = pickle.loads(pickle.dumps(ds))                   # a spawned DataLoader worker's: it maps again
    with pytest.raises(DamagedOutput, match=f"^{re.escape(shards[0])}: replaced since the dataset was opened"):
        copy[0]
    ds.files.close()                                        # no descriptor kept: the size check opens the path
    os.remove(shards[0])                                    # gone: its map still holds the file indexed
    assert all(np.array_equal(ds[i]["layers"], ref[i]["layers"]) for i in range(len(ds)))


def test_more_shards_than_a_process_keeps_mapped(outputs, monkeypatch, tmp_path):
    """A dataset of more shards than _MAPS (4 shards, 2 kept mapped) gives the same records, views, batches, id
    lookups, tokens and stream as one that maps them all, never holding more than 2 maps (the least recently used
    dropped, mapped again when read); a shard dropped and then replaced is refused when mapped again."""
    import shutil
    from elmo_pipeline.downstream import mapped
    paths = [outputs["all"], outputs["part2"]]
    ref = MappedDataset(paths)
    monkeypatch.setattr(mapped, "_MAPS", 2)
    ds = MappedDataset(paths)
    assert len(ds.units) == 4 and len(ds._maps) == 2
    for i in list(range(len(ds))) + list(range(len(ds)))[::-1]:
        a, b = ds[i], ref[i]
        assert a["id"] == b["id"] and a["tokens"] == b["tokens"] and np.array_equal(a["layers"], b["layers"])
        assert all(np.array_equal(x, y) for x, y in zip(ds.views(i), ref.views(i))) and len(ds._maps) <= 2
        assert ds.position(b["id"]) == i
    order = list(range(len(ds)))[::-1]
    assert torch.equal(ds.batch(order)["layers"], ref.batch(order)["layers"]) and len(ds._maps) == 2
    assert [b["ids"] for b in ds.stream()] == [b["ids"] for b in ref.stream()]
    out = tmp_path / "replaced"
    shutil.copytree(outputs["all"], out)
    ds = MappedDataset(str(out), tokens=False)
    first = os.path.join(str(out), ds.outputs[0].shards[0]["arrow"])
    assert sorted(ds._maps) == [0, 1]                             # the index keeps the first two it built
    ds[len(ds) - 1]                                               # unit 2 mapped, unit 0 dropped
    assert sorted(ds._maps) == [1, 2]
    shutil.copy(os.path.join(str(out), ds.outputs[0].shards[1]["arrow"]), str(out / "other.arrow"))
    os.replace(str(out / "other.arrow"), first)
    with pytest.raises(DamagedOutput, match=f"^{re.escape(first)}: replaced since the dataset was opened"):
        ds[0]


def test_a_shard_replaced_while_the_index_maps_it_is_refused(outputs, tmp_path, monkeypatch):
    """A shard file replaced (renamed over) just after building the index mapped it: the dataset refuses to open
    (DamagedOutput naming it) instead of recording the new file as the one indexed, whose rows the stream would
    then read at the mapped file's offsets."""
    import shutil
    from elmo_pipeline.downstream import mapped
    out = tmp_path / "racing"
    shutil.copytree(outputs["all"], out)
    shards = [os.path.join(str(out), s["arrow"]) for s in ElmoOutput(str(out)).shards]
    real = mapped.map_arrow_shard

    def map_then_replace(path: str, *args, **kw):
        got = real(path, *args, **kw)
        if path == shards[0]:
            shutil.copy(shards[1], str(out / "other.arrow"))
            os.replace(str(out / "other.arrow"), shards[0])
        return got
    monkeypatch.setattr(mapped, "map_arrow_shard", map_then_replace)
    with pytest.raises(DamagedOutput, match=f"^{re.escape(shards[0])}: replaced while the dataset was opened"):
        MappedDataset(str(out), tokens=False)


def _streamed(ds: MappedDataset, output: ElmoOutput, **kw) -> list[dict]:
    """The stream's sentences as records (id, doc_id, layers stacked as ElmoOutput does), each batch checked
    before the next overwrites its buffer."""
    records = []
    for b in ds.stream(**kw):
        assert [len(v) for v in b["vectors"]] == [int(b["starts"][-1] + b["lengths"][-1])] * len(b["vectors"])
        for j, sid in enumerate(b["ids"]):
            a, n = int(b["starts"][j]), int(b["lengths"][j])
            records.append({"id": sid, "doc_id": b["doc_ids"][j],
                            "layers": output.stack([v[a: a + n].numpy() for v in b["vectors"]])})
        if kw.get("padded"):
            want = collate([records[-len(b["ids"]) + j] for j in range(len(b["ids"]))])
            assert torch.equal(b["layers"], want["layers"]) and torch.equal(b["mask"], want["mask"])
    return records


@pytest.mark.parametrize("name", ["all", "fp16"])
def test_stream_records_identical_to_sentences(outputs, name):
    output = ElmoOutput(outputs[name])
    want = list(output.sentences("arrow"))
    assert [r["id"] for r in want] == [r["id"] for r in output.sentences("parquet")]
    ds = MappedDataset(outputs[name], dtype=None)
    assert ds.stored_dtype == np.dtype("float16" if name == "fp16" else "float32")
    for kw in ({}, {"batch_tokens": 1}, {"batch_tokens": 9, "padded": True}):
        got = _streamed(ds, output, **kw)
        assert [(r["id"], r["doc_id"]) for r in got] == [(r["id"], r["doc_id"]) for r in want]
        assert all(np.array_equal(a["layers"], b["layers"]) for a, b in zip(got, want))      # bit for bit
    batches = list(ds.stream(batch_tokens=9))
    assert len(batches) > len(output.shards) and all(int(b["lengths"].sum()) <= 9 or len(b["ids"]) == 1 for b in batches)
    top = output.layer_names[-1]
    b = next(ds.stream(layers=[top]))
    assert len(b["vectors"]) == 1 and b["vectors"][0].dtype == getattr(torch, ds.stored_dtype.name)
    assert np.array_equal(b["vectors"][0][: int(b["lengths"][0])].numpy(), ds.views(0)[-1])
    with pytest.raises(ValueError, match="layers"):
        next(ds.stream(layers=["layer_9"]))


def test_stream_labelled_partitions(outputs):
    both = MappedDataset([outputs["all"], outputs["part2"]], labels={"1": 1, "3": 0, "5": 1}, tokens=False)
    ids, labels = [], []
    for b in both.stream(batch_tokens=1000, padded=True):        # vectors are valid until the next batch
        ids += b["ids"]
        labels += b["label"].tolist()
        for j, sid in enumerate(b["ids"]):
            a, n = int(b["starts"][j]), int(b["lengths"][j])
            want = both[both.position(sid)]["layers"]
            assert np.array_equal(b["layers"][j, :, :n].numpy(), want)
            assert np.array_equal(ElmoOutput(outputs["all"]).stack([v[a: a + n].numpy() for v in b["vectors"]]), want)
    assert ids == [both[i]["id"] for i in range(len(both))] and labels == [1, 0, 1, 1, 0]


@pytest.mark.parametrize("name", ["all", "fp16"])
def test_read_ahead_and_reused_batches_equal_fresh_ones(outputs, name):
    """Batches built by the background thread into reused buffers equal fresh ones, batch by batch, as stored
    and as float32 (fp16 -> float32 by torch: bit-identical to the records' conversion)."""
    ref = ElmoDataset(outputs[name])
    for dtype in (None, "float32"):
        ds = MappedDataset(outputs[name], dtype=dtype, tokens=False)
        sampler = BucketBatchSampler(ds.lengths, batch_size=3, shuffle=True, seed=2)
        fresh = [ds.batch(b) for b in sampler]
        for ahead in (0, 1, 3):
            got = ds.batches(sampler, reuse=True, ahead=ahead)
            for want, b in zip(fresh, got, strict=True):
                assert torch.equal(b["layers"], want["layers"]) and b["ids"] == want["ids"]
            streamed = [(b["ids"], b["layers"].clone()) for b in ds.stream(batch_tokens=7, padded=True, ahead=ahead)]
            assert streamed[0][1].dtype == getattr(torch, dtype or ds.stored_dtype.name)
            for ids, layers in streamed:
                assert torch.equal(layers, collate([ref[ds.position(i)] for i in ids])["layers"].to(layers.dtype))
    it = ds.stream(batch_tokens=1)
    next(it)
    it.close()                                                       # stops the read-ahead thread
    assert not [t for t in threading.enumerate() if t.name.startswith("read-ahead")]


def test_stream_plan_caps_rows_and_padded_tokens():
    """A stream batch spans at most batch_tokens rows and, given padded_tokens, holds at most that many tokens
    once padded (sentences x the longest); a longer sentence alone; never across shards; the rows of the
    sentences left out (unlabelled) count in the span."""
    from elmo_pipeline.downstream.stream_rows import stream_plan
    lengths = np.array([2, 2, 5, 1, 1, 1, 20, 3, 3])
    starts = np.concatenate([np.cumsum(np.r_[0, lengths[:6]])[:-1], np.cumsum(np.r_[0, lengths[6:]])[:-1]])
    plan = lambda kept, rows, padded: [q.tolist() for _, q, _ in stream_plan(  # noqa: E731
        np.asarray(kept), [0, 6, 9], starts, lengths, rows, padded)]
    assert plan(range(9), 10, 10) == [[0, 1], [2, 3], [4, 5], [6], [7, 8]]
    assert plan(range(9), 10, 0) == [[0, 1, 2, 3], [4, 5], [6], [7, 8]]
    assert plan(range(9), 4, 10) == [[0, 1], [2], [3, 4, 5], [6], [7], [8]]
    assert plan([0, 3, 4, 5], 4, 10) == [[0], [3, 4, 5]]             # 0 and 3 span 10 rows


def test_stream_batches_default_to_a_size_in_bytes(tmp_path, monkeypatch, outputs):
    """Stream batches span the rows of STREAM_BYTES stored bytes by default, padded ones make a padded batch of
    at most PADDED_BYTES (it stays in the CPU cache); an explicit batch_tokens is kept (rows). 20-token sentences
    of one 64-wide float16 layer (128 bytes a row), 40 a shard; then sentences of mixed lengths."""
    from benchmarks.read_path import big_output
    monkeypatch.setattr(mapped_stream, "PADDED_BYTES", 256 * 128)
    monkeypatch.setattr(mapped_stream, "STREAM_BYTES", 512 * 128)
    ds = MappedDataset(big_output(str(tmp_path), 4000, 40), tokens=False, dtype=None)
    rows = lambda **kw: [int(b["lengths"].sum()) for b in ds.stream(**kw)]     # noqa: E731
    assert max(rows(padded=True)) == 240 and max(rows()) == 500 and max(rows(padded=True, batch_tokens=512)) == 500
    assert sum(rows(padded=True)) == sum(rows()) == 4000
    mixed = MappedDataset(outputs["all"], tokens=False)                  # 3 layers, float32 batches
    monkeypatch.setattr(mapped_stream, "PADDED_BYTES", 10 * 3 * mixed.dim * 4)  # 10 padded tokens
    shapes = [tuple(b["layers"].shape) for b in mixed.stream(padded=True)]
    assert all(B * T <= 10 or B == 1 for B, _, T, _ in shapes) and sum(B for B, *_ in shapes) == len(mixed)
    assert len({T for _, _, T, _ in shapes}) > 1


def test_opening_reads_the_index_pages_only(tmp_path):
    """Opening a dataset whose shards are not in the page cache reads the pages its index touches (ids, codes),
    not the vectors around them: neither pyarrow's read-ahead of the record batch (8 MiB a shard here) nor the
    kernel's read-around of the first faults. Two 20 MB shards (1,024-wide float16 vectors); their pages dropped
    (written back, POSIX_FADV_DONTNEED) first. The records read after it equal pyarrow's."""
    from benchmarks.read_path import big_output, cached_bytes
    from elmo_pipeline.fsio.fs import release_written, url_fs
    out = big_output(str(tmp_path), 20_000, 500, width=1024)
    shards = sorted(glob.glob(os.path.join(out, "arrow", "*.arrow")))
    assert len(shards) == 2 and all(os.path.getsize(s) > 20e6 for s in shards)
    for s in shards:
        release_written(url_fs(s)[0], s)
    if any(cached_bytes(s) > 1 << 20 for s in shards):
        pytest.skip("the file system keeps the shards' pages in memory (tmpfs?): nothing to measure")
    ds = MappedDataset(out, tokens=False, dtype=None)
    assert len(ds) == 1000
    assert all(cached_bytes(s) < 1 << 20 for s in shards), [cached_bytes(s) for s in shards]
    table = pa.ipc.open_file(shards[1]).read_all()
    assert np.array_equal(ds.views(999)[0], np.stack(table.column("average").to_numpy(zero_copy_only=False)[-20:]))


def test_converted_batches_equal_numpys_conversion():
    """fp16 sentences become a float32 batch converted on the way in: equal to numpy's conversion, layer 0
    duplicated, zero past each length, also after a batch of longer sentences in the same buffers."""
    from elmo_pipeline.downstream.batching import Batcher
    rng = np.random.default_rng(0)
    batcher = Batcher(8, "float32", reuse=True)
    for lengths in ([7, 7, 7, 7, 7], [5, 6, 6, 5, 6]):
        sents = [[rng.standard_normal((n, 4)).astype(np.float16), rng.standard_normal((n, 8)).astype(np.float16)]
                 for n in lengths]
        want = np.zeros((len(lengths), 2, max(lengths), 8), np.float32)
        for b, (l0, l1) in enumerate(sents):
            want[b, 0, : len(l0)] = np.concatenate([l0, l0], 1)
            want[b, 1, : len(l1)] = l1
        layers, mask = batcher.from_sentences(sents)
        assert layers.dtype == torch.float32 and np.array_equal(layers.numpy(), want)
        assert mask.sum(1).tolist() == lengths


def test_read_ahead_raises_the_producers_error():
    from elmo_pipeline.downstream.stream_rows import read_ahead

    def broken():
        yield 1
        raise OSError("disk gone")
    it = read_ahead(broken(), 2)
    assert next(it) == 1
    with pytest.raises(OSError, match="disk gone") as e:
        next(it)
    assert any(f.name == "broken" for f in e.traceback)              # the producer's frame, in its thread
    assert not [t for t in threading.enumerate() if t.name.startswith("read-ahead")]


def _read_ahead_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("read-ahead")]


@pytest.mark.parametrize("name", ["all", "fp16"])
def test_read_ahead_same_batches_in_the_same_order_and_no_thread_left_after_break(outputs, name):
    """ahead=1 and 2 give the batches of ahead=0, value for value, in the same order, run after run; the thread is
    started by the first next() (none while the iterator is only made) and gone once a loop breaks early."""
    for dtype in (None, "float32"):
        ds = MappedDataset(outputs[name], dtype=dtype, tokens=False)
        sampler = BucketBatchSampler(ds.lengths, batch_size=2, shuffle=True, seed=5)
        runs = {}
        for ahead in (0, 1, 2, 2):
            got = [(b["ids"], b["layers"].clone(), b["mask"].clone()) for b in ds.batches(sampler, reuse=True, ahead=ahead)]
            got += [(b["ids"], b["layers"].clone(), b["mask"].clone())
                    for b in ds.stream(batch_tokens=5, padded=True, ahead=ahead)]
            runs.setdefault(0, got)
            assert len(got) == len(runs[0]) > 4
            for (i0, l0, m0), (i1, l1, m1) in zip(runs[0], got):
                assert i0 == i1 and torch.equal(l0, l1) and torch.equal(m0, m1)
        for b in ds.stream(batch_tokens=5, padded=True, ahead=2):      # the batch in hand is never written
            held = b["layers"].clone()
            time.sleep(0.002)                                            # the thread makes the next ones meanwhile
            assert torch.equal(b["layers"], held)
    lazy = ds.stream(batch_tokens=1, padded=True, ahead=2)
    assert not _read_ahead_threads()                                  # made, not started: nothing to fork with
    for j, _ in enumerate(lazy):
        assert _read_ahead_threads()
        if j == 1:
            break
    del lazy
    for b in ds.batches(sampler, ahead=2):
        break
    del b
    assert not _read_ahead_threads()


def test_id_lookup_every_id_and_hash_collisions(outputs, monkeypatch):
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False)
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert [ds.position(s) for s in ids] == list(range(len(ds)))
    before = ds.index_bytes()
    assert ds.index.id_table is not None and before >= 16 * len(ds)     # 16 bytes a sentence: hash + position
    for missing in ("a.txt:99#0", "", "b.txt:1#1", ids[0] + " "):
        with pytest.raises(KeyError):
            ds.position(missing)
    import elmo_pipeline.downstream.id_table as id_table
    monkeypatch.setattr(id_table, "id_hash", lambda key: 7)        # every id collides: the stored id decides
    same = MappedDataset([outputs["all"], outputs["part2"]], tokens=False)
    assert [same.position(s) for s in ids] == list(range(len(ds)))
    with pytest.raises(KeyError):
        same.position("a.txt:99#0")
    labelled = MappedDataset(outputs["all"], labels={"1": 1, "3": 0}, tokens=False)
    assert labelled.position(labelled[1]["id"]) == 1
    with pytest.raises(KeyError):
        labelled.position(ids[1])                                  # present, but unlabelled

def test_bucket_sampler_deterministic_split_and_resumable():
    lengths = np.random.default_rng(0).integers(1, 60, 1000)
    s = BucketBatchSampler(lengths, batch_size=16, shuffle=True, seed=3, bucket_batches=8)
    e0 = list(s)
    assert e0 == list(BucketBatchSampler(lengths, batch_size=16, shuffle=True, seed=3, bucket_batches=8))
    assert sorted(p for b in e0 for p in b) == list(range(1000))
    s.set_epoch(1)
    assert list(s) != e0
    s.set_epoch(0, start_batch=10)
    assert list(s) == e0[10:] and len(s) == len(e0) - 10
    ranks = [list(BucketBatchSampler(lengths, 16, shuffle=True, seed=3, bucket_batches=8, rank=r, world_size=3))
             for r in range(3)]
    assert len({len(r) for r in ranks}) == 1 and {p for r in ranks for b in r for p in b} == set(range(1000))
    padded = lambda batches: sum(len(b) * lengths[b].max() for b in batches) / lengths.sum()   # noqa: E731
    plain = list(BucketBatchSampler(lengths, 16, bucket_batches=0))
    assert plain[1] == list(range(16, 32)) and padded(e0) < 1.2 < 1.5 < padded(plain)
    capped = list(BucketBatchSampler(lengths, 64, max_tokens=300))
    assert all(len(b) * lengths[b].max() <= 300 or len(b) == 1 for b in capped)
    with pytest.raises(ValueError, match="rank"):
        BucketBatchSampler(lengths, rank=2, world_size=2)


def test_probe_from_arrow_same_accuracy(outputs, tmp_path):
    (tmp_path / "labels.tsv").write_text("".join(f"{n}\t{n % 2}\n" for n in range(1, len(TEXT) + 1)))
    results = {}
    for fmt in ("parquet", "arrow"):
        report = str(tmp_path / fmt)
        assert cli_main(["probe", "--threads", "1", "--quiet", "--train", outputs["all"], "--test", outputs["all"],
                         "--labels", str(tmp_path / "labels.tsv"), "--format", fmt, "--settings", "layer2,mix",
                         "--epochs", "5", "--seeds", "1", "--out", report]) == 0
        results[fmt] = [(r["setting"], r["train_accuracy"], r["test_accuracy"])
                        for r in json.load(open(os.path.join(report, "results.json")))["summary"]]
    assert results["arrow"] == results["parquet"]


@pytest.mark.slow
def test_a_dataset_of_more_shards_than_the_kernel_maps_a_process(tmp_path):
    """An output of more shards than the kernel lets a process map (vm.max_map_count, + 2,000; one sentence a
    shard) opens and reads, in a process of its own (a dataset that maps every shard fails there once mmap does):
    the records at both ends and a batch of positions across it equal pyarrow's reading of their shards."""
    import shutil
    import subprocess
    import sys
    from benchmarks.read_path import big_output
    try:
        limit = int(open("/proc/sys/vm/max_map_count").read())
    except OSError:
        pytest.skip("no /proc/sys/vm/max_map_count: not Linux")
    if limit > 100_000:
        pytest.skip(f"vm.max_map_count is {limit}: too many shards to write here")
    n = limit + 2_000
    out = big_output(str(tmp_path), 20 * n, 1, width=8)
    code = ("import sys, numpy as np, pyarrow as pa\nfrom elmo_pipeline.downstream.mapped import MappedDataset\n"
            "ds = MappedDataset(sys.argv[1], tokens=False, dtype=None)\n"
            "def want(p):\n"
            "    path = ds.outputs[0].shard_path(p, 'arrow')\n"
            "    return np.stack(pa.ipc.open_file(path).read_all().column('average').to_numpy(zero_copy_only=False))\n"
            "picks = [0, 1, len(ds) // 2, len(ds) - 1]\n"
            "b = ds.batch(picks)['layers'].numpy()\n"
            "assert all(np.array_equal(ds[p]['layers'][0], want(p)) and np.array_equal(b[j, 0], want(p))\n"
            "           for j, p in enumerate(picks))\n"
            "print(len(ds), len(ds._maps))\n")
    p = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True, timeout=600)
    shutil.rmtree(out)                                          # its many files (pytest keeps its last folders)
    assert p.returncode == 0 and p.stdout.split() == [str(n), "4096"], (p.returncode, p.stderr[-2000:])


@pytest.mark.slow
def test_a_dataset_alive_when_the_interpreter_ends_closes_quietly(outputs):
    """A script holding a dataset in a global, its descriptors open (a batch read), ends with status 0 and
    nothing on stderr: the dataset's finalizer may run after the interpreter took modules down (as here, where
    the script's globals include `elmo_pipeline` and `os`), and must not need them."""
    import subprocess
    import sys
    code = ("import elmo_pipeline, os\nfrom elmo_pipeline.downstream.mapped import MappedDataset\n"
            f"ds = MappedDataset({outputs['all']!r}, tokens=False)\n"
            "ds.batch(list(range(len(ds))))\nassert ds.files._open\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]


@pytest.mark.slow
def test_dataloader_workers_each_batch_once(outputs):
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False)
    sampler = BucketBatchSampler(ds.lengths, batch_size=2, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=unbatched, num_workers=2)
    batches = list(loader)                    # all held: a worker's buffer sent to this process is never built in again
    got = [b["ids"] for b in batches]
    want = [[ds[i]["id"] for i in b] for b in sampler]
    assert got == want and sorted(i for b in got for i in b) == sorted(ds[i]["id"] for i in range(len(ds)))
    assert all(torch.equal(b["layers"], ds.batch(list(p))["layers"]) for b, p in zip(batches, sampler))
    first = next(iter(loader))
    assert torch.equal(first["layers"], ds.batch(next(iter(sampler)))["layers"])


@pytest.mark.slow
def test_dataloader_reuse_builds_in_one_buffer_in_the_main_process_only(outputs):
    """reuse=True: the recipe's batches (num_workers=0) are built in one kept buffer, each equal to batch()'s
    while it is the latest; workers (num_workers=2) still send batches of their own, all right when all are held."""
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False, reuse=True)
    sampler = BucketBatchSampler(ds.lengths, batch_size=2, shuffle=True, seed=1)
    want = [ds.batch(list(p))["layers"].clone() for p in sampler]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=unbatched)
    for epoch in range(2):                                  # the buffer grows in the first, is kept for the second
        ptrs = set()
        for b, w in zip(loader, want):
            assert torch.equal(b["layers"], w)
            ptrs.add(b["layers"].data_ptr())
    assert len(ptrs) == 1 and len(want) > 2
    held = list(torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=unbatched, num_workers=2))
    assert all(torch.equal(b["layers"], w) for b, w in zip(held, want)) and len(held) == len(want)


@pytest.mark.slow
def test_dataloader_workers_fork_a_dataset_with_its_read_thread(outputs, monkeypatch):
    """Workers forked from a process whose dataset already read with two threads (its helper thread started,
    descriptors open): each worker opens its own descriptors and helper and delivers the parent's batches."""
    monkeypatch.setattr(batcher_pool, "SPLIT_BYTES", 0)
    ds = MappedDataset([outputs["all"], outputs["part2"]], tokens=False, dtype=None)
    sampler = BucketBatchSampler(ds.lengths, batch_size=3, shuffle=True, seed=2)
    want = [ds.batch(list(p))["layers"].clone() for p in sampler]
    assert ds.files._open and ds.pool._helper is not None
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=unbatched, num_workers=2)
    assert all(torch.equal(b["layers"], w) for b, w in zip(loader, want))


@pytest.mark.slow
def test_mapped_dataset_on_s3(outputs, tmp_path):
    with moto_s3("readpath") as (endpoint, fs):
        for root, _, files in os.walk(outputs["all"]):
            for name in files:
                local = os.path.join(root, name)
                fs.put_file(local, "readpath/out/" + os.path.relpath(local, outputs["all"]))
        so = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        remote = MappedDataset("s3://readpath/out", storage_options=so, cache_dir=str(tmp_path / "cache"))
        local = MappedDataset(outputs["all"])
        assert len(remote) == len(local)
        for i in range(len(local)):
            a, b = remote[i], local[i]
            assert a["id"] == b["id"] and a["tokens"] == b["tokens"] and np.array_equal(a["layers"], b["layers"])
        assert sum(len(files) for _, _, files in os.walk(tmp_path / "cache")) == 3     # every shard cached once
        assert [r["id"] for r in ElmoOutput("s3://readpath/out", so).sentences("arrow")] == [local[i]["id"] for i in range(len(local))]


@pytest.mark.parametrize("name,dtype", [("all", None), ("fp16", None), ("fp16", "float32"), ("all", "float16")])
def test_packed_batches_hold_the_stored_rows_back_to_back(outputs, monkeypatch, name, dtype):
    """batch(packed=True) and batches(packed=True) (one thread and two, reused buffers or not): each sentence's rows
    of each layer, as pyarrow reads them from the Parquet shards (converted by torch to the asked dtype), at rows
    starts[b]:starts[b] + lengths[b] of one (N, D_k) tensor per layer, back to back from row 0; ids, lengths and
    labels as the padded batch's; a DataLoader over MappedDataset(reuse=True, packed=True) fetches the same."""
    monkeypatch.setattr(batcher_pool, "SPLIT_BYTES", 0)
    table = pq.read_table(os.path.join(outputs[name], "parquet")).to_pylist()
    stored = np.float16 if name == "fp16" else np.float32
    rows = {r["id"]: r for r in table}
    labels = {i: k % 3 for k, i in enumerate(rows)}
    orders = [[3, 0, 6, 1, 7, 2], [5], [7, 6, 5, 4]]
    for threads in (1, 2):
        ds = MappedDataset(outputs[name], dtype=dtype, tokens=False, threads=threads, labels=labels)
        want_dtype = getattr(torch, dtype or np.dtype(stored).name)
        for reuse in (False, True):
            for order, got in zip(orders, ds.batches(orders, reuse=reuse, packed=True)):
                padded = ds.batch(order)
                assert got["ids"] == padded["ids"] and torch.equal(got["lengths"], padded["lengths"])
                assert torch.equal(got["label"], padded["label"]) and "layers" not in got
                assert got["starts"].tolist() == np.concatenate([[0], np.cumsum(got["lengths"])[:-1]]).tolist()
                for b, sid in enumerate(got["ids"]):
                    a, n = int(got["starts"][b]), int(got["lengths"][b])
                    for k, layer in enumerate(ds.layers):
                        want = torch.from_numpy(np.asarray(rows[sid][layer], dtype=stored)).to(want_dtype)
                        v = got["vectors"][k]
                        assert v.dtype == want_dtype and v.shape[0] == int(got["lengths"].sum())
                        assert torch.equal(v[a: a + n], want)
    loader = torch.utils.data.DataLoader(MappedDataset(outputs[name], dtype=dtype, tokens=False, reuse=True,
                                                       packed=True), batch_sampler=orders, collate_fn=unbatched)
    for order, got in zip(orders, loader):                  # the DataLoader recipe's fetch gives the same
        want = ds.batch(order, packed=True)
        assert got["ids"] == want["ids"] and all(torch.equal(x, y) for x, y in zip(got["vectors"], want["vectors"]))
