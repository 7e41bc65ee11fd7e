"""Unit tests of the pipeline's plain functions: read, tokenize, batch, select layers, write, finalize."""
import bz2
import dataclasses
import gzip
import json
import os

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.transforms import embed
from elmo_pipeline.model.batching import plan_batches
from elmo_pipeline.model.batching import padding
from elmo_pipeline.transforms.records import Blank, Document, EmbeddedBatch, Item
from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.fsio import expand as expand_inputs
from elmo_pipeline.transforms.ids import file_labels
from elmo_pipeline.transforms.read import read_documents
from elmo_pipeline.tokenization import align_tokens, tokenize_document, tokenize_text
from elmo_pipeline.formats.hdf5 import hdf5_key
from elmo_pipeline.formats.parquet import layer_columns, sentence_table, token_table
from elmo_pipeline.output.finalize import finalize, plan_from_staging
from elmo_pipeline.output.staging import ShardSpec, Staging, shard_columns

TEXT = 'Dr. Smith left the U.S. in 2001. He said "hello, world" -- it\'s a well-known <unk> fact!'


def test_raw_tokenizer_is_moses_style_with_exact_offsets():
    sents = tokenize_document(TEXT)
    assert [list(s.tokens) for s in sents] == [
        ["Dr.", "Smith", "left", "the", "U.S.", "in", "2001", "."],
        ["He", "said", '"', "hello", ",", "world", '"', "--", "it", "'s", "a", "well", "@-@", "known", "<unk>", "fact", "!"]]
    for s in sents:
        for tok, (a, b) in zip(s.tokens, s.offsets):
            assert TEXT[a:b] == {"@-@": "-"}.get(tok, tok)
    assert tokenize_text(TEXT) == [list(s.tokens) for s in sents]


def test_whitespace_tokenizer_and_no_split():
    text = "  a  b\tc . d  "
    (s,) = tokenize_document(text, "whitespace")
    assert s.tokens == ("a", "b", "c", ".", "d") and [text[x:y] for x, y in s.offsets] == list(s.tokens)
    assert len(tokenize_document("One. Two.", "raw", split_sentences=False)) == 1
    assert tokenize_document("   ") == [] and tokenize_document(" ", "whitespace") == []
    with pytest.raises(ValueError):
        tokenize_document("x", "spacy")


def test_align_tokens_unfound_token_gets_empty_span():
    assert align_tokens("ab cd", ["ab", "zz", "cd"]) == [(0, 2), (2, 2), (3, 5)]


def test_read_text_lines_jsonl_parquet_compressed(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"First doc.\n\nSecond doc.\n"))
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(b"Third.\n"))
    files = expand_inputs([str(tmp_path / "*.txt.*")])
    labels = file_labels(files)
    assert labels == {str(tmp_path / "a.txt.gz"): "a.txt.gz", str(tmp_path / "b.txt.bz2"): "b.txt.bz2"}
    docs = [d for f in files for d in read_documents(f, "text", labels[f])]
    assert docs == [Document("a.txt.gz:1", "First doc."), Blank("a.txt.gz:2"), Document("a.txt.gz:3", "Second doc."),
                    Document("b.txt.bz2:1", "Third.")]      # blank records are reported (and counted), not documents
    assert list(read_documents(files[1], "lines", "b"))[0].split_sentences is False

    j = tmp_path / "d.jsonl"
    j.write_text('{"id": "x", "body": "Hi there."}\nnot json\n{"id": "y"}\n{"id": "z", "body": 5}\n')
    recs = list(read_documents(str(j), "jsonl", "d.jsonl", text_field="body", id_field="id"))
    assert recs[0] == Document("x", "Hi there.", source="d.jsonl:1")    # the id's source names duplicates
    assert [type(r) for r in recs[1:]] == [DeadLetter] * 3 and recs[1].id == "d.jsonl:2"

    pq.write_table(pa.table({"t": ["One.", None, "Two."], "k": ["p", "q", "r"]}), tmp_path / "e.parquet")
    recs = list(read_documents(str(tmp_path / "e.parquet"), "parquet", "e", text_field="t", id_field="k"))
    assert recs[0] == Document("p", "One.", source="e:1") and isinstance(recs[1], DeadLetter) and recs[2].doc_id == "r"
    with pytest.raises(FileNotFoundError):
        expand_inputs([str(tmp_path / "nothing*")])


def test_duplicate_ids_are_dead_letters_naming_every_copy():
    from elmo_pipeline.transforms.ids import split_duplicate_ids
    assert list(split_duplicate_ids("x", [Document("x", "One.", source="d:1")])) == [Document("x", "One.", source="d:1")]
    dup = list(split_duplicate_ids("x", [Document("x", "Two.", source="d:7"), Document("x", "One.", source="d:1")]))
    assert [(d.id, d.level, d.excerpt) for d in dup] == [("d:1", "record", "One."), ("d:7", "record", "Two.")]
    assert dup[0].reason == "duplicate id: 2 records have the id 'x' (--id-field): d:1, d:7"


def test_plan_batches_respects_budget_and_sorts():
    lengths = [5, 30, 6, 29, 1, 100]
    batches = plan_batches(lengths, max_tokens=64)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 2) <= 64
    assert [lengths[b[0]] for b in batches] == sorted(lengths[b[0]] for b in batches)
    assert plan_batches(lengths, 1000, sort=False) == [[0, 1, 2, 3, 4, 5]]
    assert padding([2, 4]) == (6, 8)


def test_layer_selection():
    assert embed.parse_layers("all", 3) == [0, 1, 2] and embed.parse_layers("top", 3) == [2]
    assert embed.parse_layers("0,2", 3) == [0, 2] and embed.parse_layers("average", 3) == "average"
    for bad in ("3", "x", "1,1"):
        with pytest.raises(ValueError):
            embed.parse_layers(bad, 3)
    assert layer_columns([0, 2], 4, False) == [("layer_0", 2), ("layer_2", 4)]


def test_device_chooser_never_falls_back_to_cpu():
    import torch

    from elmo_pipeline.model.device import resolve_device
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert resolve_device("auto", share_gpus=True) == torch.device("cpu") == resolve_device(-1)
    for d in ("cuda", "cuda:1", 0):
        with pytest.raises(RuntimeError):
            resolve_device(d, share_gpus=True)


@pytest.mark.slow
def test_claim_gpu_gives_each_holder_its_own(tmp_path):
    import subprocess
    import sys
    code = ("import sys, time; from model.device import claim_gpu; "
            f"print(claim_gpu(2, {str(tmp_path)!r}), flush=True); time.sleep(3)")
    p1 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    first = p1.stdout.readline().strip()
    second = subprocess.run([sys.executable, "-c", code.replace("time.sleep(3)", "0")], capture_output=True, text=True).stdout.strip()
    p1.wait()
    assert {first, second} == {"0", "1"}


SPEC = ShardSpec(("parquet", "hdf5"), "sentence", (("layer_0", 2), ("layer_1", 4), ("layer_2", 4)), (0, 1, 2),
                 False, "float32", 1 << 20, 3, 4)


def _batch() -> EmbeddedBatch:
    """Two embedded sentences (3 and 1 tokens) of a 3-layer model with 2P = 4, packed as EmbedBatches gives them."""
    rng = np.random.default_rng(0)
    items = [Item(f"d/x:1#{i}", "d/x:1", i, tuple(f"t{k}" for k in range(n)), tuple((2 * k, 2 * k + 1) for k in range(n)))
             for i, n in enumerate([3, 1])]
    vectors = rng.standard_normal((3, 4, 4)).astype(np.float32)
    vectors[0, :, 2:] = vectors[0, :, :2]                 # layer 0 is [x, x]
    return EmbeddedBatch(items, vectors, np.array([0, 3, 4]))


def test_tables_sentence_and_token_layout():
    batch = _batch()
    cols = list(SPEC.columns)
    t = sentence_table(shard_columns([(batch, 0), (batch, 1)], SPEC), cols)
    assert t.schema.field("layer_1").type == pa.list_(pa.list_(pa.float32(), 4))
    assert t.column("tokens").to_pylist() == [["t0", "t1", "t2"], ["t0"]]
    assert np.array_equal(np.array(t.column("layer_2")[0].as_py()), batch.vectors[2, :3])
    assert np.array_equal(np.array(t.column("layer_0")[1].as_py()), batch.vectors[0, 3:, :2])
    assert t.column("token_offsets").to_pylist()[0] == [[0, 1], [2, 3], [4, 5]]
    half = dataclasses.replace(SPEC, dtype="float16", layout="token")
    tt = token_table(shard_columns([(batch, 0), (batch, 1)], half), cols)
    assert tt.num_rows == 4 and tt.schema.field("layer_0").type == pa.list_(pa.float16(), 2)
    assert tt.column("token_index").to_pylist() == [0, 1, 2, 0] and tt.column("end").to_pylist() == [1, 3, 5, 1]
    assert tt.column("id").to_pylist() == ["d/x:1#0"] * 3 + ["d/x:1#1"]


def test_stage_and_finalize(tmp_path):
    out = str(tmp_path / "out")
    staging = out + "/_staging/run1"
    batch = _batch()
    s1 = Staging(staging).shard([(batch, 1)], SPEC)
    s0 = Staging(staging).shard([(batch, 0)], SPEC)
    assert {s1.first_id, s0.first_id} == {"d/x:1#1", "d/x:1#0"}
    Staging(staging).counts("x", {"input_records": 1, "blank_records": 0})
    staged = plan_from_staging(staging, ["x"])
    assert len(staged.shards) == 2
    m = finalize(out, staging, staged, {})
    assert sorted(os.listdir(out)) == ["_SUCCESS", "hdf5", "manifest.json", "metrics.prom", "parquet", "report.html"]
    assert m["counts"]["sentences"] == 2 and m["counts"]["tokens_written"] == 4
    assert [s["parquet"] for s in m["shards"]] == ["parquet/part-00000-of-00002.parquet", "parquet/part-00001-of-00002.parquet"]
    assert pq.read_table(os.path.join(out, m["shards"][0]["parquet"])).column("id").to_pylist() == ["d/x:1#0"]
    with h5py.File(os.path.join(out, m["shards"][1]["hdf5"])) as f:
        assert list(f) == [hdf5_key("d/x:1#1")] == ["d%2Fx:1#1"]
        assert np.array_equal(f["d%2Fx:1#1"][...], batch.vectors[:, 3:])
    assert json.load(open(os.path.join(out, "manifest.json")))["schema_version"] == 1


def test_dead_letters_holding_line_separators_are_read_back_whole(tmp_path):
    """A dead letter whose id, reason or excerpt holds U+0085, U+2028/2029 or \x1c-\x1e (valid text, written as
    is in its JSON line) is one dead letter at Finalize, not a damaged staged file that fails every round."""
    from elmo_pipeline.formats.layout import DeadLetter
    staging = str(tmp_path / "out" / "_staging" / "run1")
    Staging(staging).shard([(_batch(), 0)], SPEC)
    Staging(staging).counts("x", {"input_records": 2, "blank_records": 0})
    odd = [DeadLetter("d/x:2#0", "too long: 5 tokens", "word\x85word\u2028word\u2029\x1cend"),
           DeadLetter("d/x:3\u2028", "unreadable record: x", "", level="record")]
    Staging(staging).dead_letters(odd)
    assert sorted(plan_from_staging(staging, ["x"]).dead, key=str) == sorted(odd, key=str)


def test_layer_sources_follow_the_selection():
    v = _batch().vectors
    for sel, h5 in [((2,), v[2]), ("average", v.mean(0)), ((0, 2), v[[0, 2]]), ((0, 1, 2), v)]:
        spec = dataclasses.replace(SPEC, selection=sel)
        assert np.array_equal(spec.sources(v)[1], h5)
    cols, _ = dataclasses.replace(SPEC, selection=(0, 2)).sources(v)
    assert np.array_equal(cols[0], v[0, :, :2]) and np.array_equal(cols[1], v[2])
    assert SPEC.bytes_per_token == (2 + 4 + 4 + 3 * 4) * 4


def test_layer_sources_from_only_the_layers_read():
    """With only ShardSpec.layers_read copied out of the model, the columns and HDF5 sources are the same."""
    v = _batch().vectors
    for sel in [(2,), (0, 2), (2, 0), (1,), "average", (0, 1, 2)]:
        spec = dataclasses.replace(SPEC, selection=sel)
        layers = spec.layers_read
        assert layers is None if sel in ("average", (0, 1, 2)) else layers == tuple(sorted(sel))
        cols, h5 = spec.sources(v)
        cols2, h52 = spec.sources(v if layers is None else v[list(layers)], layers)
        assert all(np.array_equal(a, b) for a, b in zip(cols, cols2)) and np.array_equal(h5, h52)


def test_finalize_lists_dead_letters(tmp_path):
    from elmo_pipeline.output.staging import Staging
    out = str(tmp_path / "o")
    letters = [DeadLetter("f:2", "unreadable record", "{", level="record"), DeadLetter("f:1#0", "too long", "x")]
    Staging(out + "/_staging/r").dead_letters(letters)
    Staging(out + "/_staging/r").dead_letters(letters[:1])      # a retried bundle stages its letters again
    Staging(out + "/_staging/r").counts("f", {"input_records": 2, "blank_records": 0})
    m = finalize(out, out + "/_staging/r", plan_from_staging(out + "/_staging/r", ["f"]), {})
    assert m["counts"]["dead_letters"] == 2 and m["counts"]["dead_letter_sentences"] == 1
    assert m["counts"]["documents"] == 1 and m["counts"]["record_dead_letters"] == 1
    lines = open(os.path.join(out, "dead_letters/part-00000-of-00001.jsonl")).read().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["f:1#0", "f:2"]


def test_write_shards_in_background_keeps_order_and_raises_errors(tmp_path):
    """WriteShards (the DoFn, driven by hand as a runner would) writes full shards on its own threads:
    every shard comes out once, in order, by the bundle's end; a failing write raises in the Beam thread."""
    from elmo_pipeline.transforms.write_step import WriteShards
    batches = [_batch()] * 3                                  # 6 sentences, shards of 2
    dofn = WriteShards(Staging(str(tmp_path / "st")), SPEC, 2)
    dofn.setup()
    dofn.start_bundle()
    infos = [info for b in batches for info in dofn.process(b)]
    assert len(infos) == 3 - WriteShards.WRITERS              # the last WRITERS shards are still being written
    infos += [wv.value for wv in dofn.finish_bundle()]
    assert [i.sentences for i in infos] == [2, 2, 2] and len({i.files["parquet"] for i in infos}) == 3
    assert all(pq.read_table(i.files["parquet"]).num_rows == 2 for i in infos)
    (tmp_path / "blocked").write_text("a file where the staging folder should be")
    dofn.staging = Staging(str(tmp_path / "blocked" / "st"))
    dofn.start_bundle()
    with pytest.raises(OSError):
        for b in batches:
            list(dofn.process(b))
        list(dofn.finish_bundle())
    dofn.teardown()


def test_tokenizer_process_resolution(monkeypatch):
    from elmo_pipeline.pipeline.workers import tokenizer_processes as n
    dask = "apache_beam.runners.dask.dask_runner.DaskRunner"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert n("auto", "wikitext", True, "FnApiRunner") == 2 and n("auto", "wikitext", True, "FnApiRunner", 2) == 1
    assert n("auto", "whitespace", True, "FnApiRunner") == 0 and n("auto", "moses", False, dask) == 0
    assert n("on", "whitespace", False, "DataflowRunner") == 2 and n("off", "moses", True, "x") == 0
    with pytest.raises(ValueError, match="DaskRunner"):
        n("on", "moses", False, dask)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert n("auto", "wikitext", True, "FnApiRunner") == 0 and n("on", "wikitext", True, "FnApiRunner") == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert n("auto", "wikitext", True, "FnApiRunner", 4) == 2


def test_release_written_syncs_local_files_and_skips_object_stores(tmp_path, monkeypatch):
    """A staged local shard is synced and its pages dropped (same bytes); memory:// and friends are left alone."""
    import fsspec

    from elmo_pipeline.fsio import release_written
    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("sync"))
    path = tmp_path / "x.parquet"
    path.write_bytes(b"abc" * 1000)
    release_written(fsspec.filesystem("file"), str(path))
    assert path.read_bytes() == b"abc" * 1000 and calls == ["sync"]
    mem = fsspec.filesystem("memory")
    mem.pipe_file("/x.parquet", b"abc")
    release_written(mem, "/x.parquet")
    assert calls == ["sync"] and mem.cat_file("/x.parquet") == b"abc"


def test_beams_s3_flags_become_the_storage_options():
    """Beam's --s3_* flags configure s3fs: temporary credentials' --s3_session_token too (it was dropped, so a run
    with STS credentials sent the key without its token and was refused by S3), --s3_verify and --s3_disable_ssl
    (accepted and ignored before)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from elmo_pipeline.pipeline.plan import storage_options
    so = storage_options(PipelineOptions(["--s3_endpoint_url", "http://127.0.0.1:9", "--s3_access_key_id", "AKID",
                                          "--s3_secret_access_key", "SECRET", "--s3_session_token", "TOKEN",
                                          "--s3_region_name", "eu-west-1"]))["s3"]
    assert (so["endpoint_url"], so["key"], so["secret"], so["token"], so["client_kwargs"]) == (
        "http://127.0.0.1:9", "AKID", "SECRET", "TOKEN", {"region_name": "eu-west-1"})
    assert "token" not in storage_options(PipelineOptions([]))["s3"]
    so = storage_options(PipelineOptions(["--s3_verify", "false", "--s3_disable_ssl"]))["s3"]
    assert so["client_kwargs"] == {"verify": False} and so["use_ssl"] is False
    assert storage_options(PipelineOptions(["--s3_verify", "/etc/ca.pem"]))["s3"]["client_kwargs"] == {
        "verify": "/etc/ca.pem"}


def test_a_lost_local_worker_process_interrupts_the_runners_wait():
    """Beam's thread that waits for a local worker process raises when the process exits with a status; the
    launcher's main thread, waiting for that worker's bundle with no end (a future never resolved), gets WorkerLost
    at once. Another thread's error is left to the hook before; nothing is watched after the block."""
    import concurrent.futures
    import signal
    import threading
    import time

    from elmo_pipeline.pipeline.workers import LOST_SIGNAL, WorkerLost, lost_workers_end_the_run

    def exits(name, message):
        def run():
            time.sleep(0.3)
            raise RuntimeError(message)
        threading.Thread(target=run, name=name).start()
    seen, before = [], threading.excepthook
    usr2_before = signal.getsignal(getattr(signal, LOST_SIGNAL))
    threading.excepthook = lambda args: seen.append(str(args.exc_value))
    try:
        t0 = time.time()
        with pytest.raises(WorkerLost, match="return code 137"):
            with lost_workers_end_the_run():
                exits("other", "not a worker")
                exits("run_worker", "Worker subprocess exited with return code 137")
                concurrent.futures.Future().result()      # what FnApiRunner waits on for the lost bundle
        assert time.time() - t0 < 5 and seen == ["not a worker"]
        with lost_workers_end_the_run():
            pass
        exits("run_worker", "Worker subprocess exited with return code 0")
        time.sleep(0.6)
        assert seen[-1] == "Worker subprocess exited with return code 0"
        assert signal.getsignal(getattr(signal, LOST_SIGNAL)) is usr2_before
    finally:
        threading.excepthook = before


def test_the_lost_worker_watch_leaves_the_signal_as_it_found_it():
    """pipeline/workers.lost_workers_end_the_run puts back the disposition of its signal it found (it left SIGUSR2
    ignored for good: the rest of the process and every process started after a run ignored it); a signal sent by a
    lost worker's thread just as the block ends, still pending, ends nothing."""
    import signal
    import threading

    from elmo_pipeline.pipeline.workers import LOST_SIGNAL, lost_workers_end_the_run
    sig = getattr(signal, LOST_SIGNAL)
    before = signal.signal(sig, signal.SIG_DFL)
    try:
        with lost_workers_end_the_run():
            pass
        assert signal.getsignal(sig) is signal.SIG_DFL
        with open("/proc/self/status") as f:       # what every process started from now on inherits
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (sig - 1)), "a process started after the run ignores the signal"
        with lost_workers_end_the_run():      # the worker's thread signals while the signal is blocked: left pending
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            t = threading.Thread(target=lambda: (_ for _ in ()).throw(
                RuntimeError("Worker subprocess exited with return code 9")), name="run_worker")
            t.start()
            t.join()
            assert sig in signal.sigpending()
        assert signal.getsignal(sig) is signal.SIG_DFL and sig not in signal.sigpending()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        signal.signal(sig, before)
