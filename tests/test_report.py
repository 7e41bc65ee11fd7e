"""The run report (output/report.py, report.html beside manifest.json) and the progress bar by input bytes
(transforms/progress.py): the numbers from small staged data, Finalize (also a rerun of an interrupted one),
a whole run, and percent / ETA from bytes."""
import gzip
import io
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.output import finalize, ownership
from elmo_pipeline.transforms import progress
from elmo_pipeline.transforms.read import read_documents
from elmo_pipeline.transforms.records import Document, EmbeddedBatch, Item
from elmo_pipeline.output.report import build_report, length_histogram, report_data, timeline
from elmo_pipeline.output.stats import RunStats, merge_stats
from elmo_pipeline.output.sink import Sink
from elmo_pipeline.output.staging import ShardSpec, Staging

SPEC = ShardSpec(("parquet", "hdf5"), "sentence", (("layer_0", 2), ("layer_1", 4)), (0, 1), False, "float32",
                 1 << 20, 2, 4)
SECTIONS = ("summary", "tokens-per-second", "sentence-lengths", "padding", "time-per-stage", "dead-letters")


def _stats(t0=1_700_000_000.0) -> list[dict]:
    a, b = RunStats(), RunStats()
    a.time("embed", 2.0)
    a.time("tokenize", 0.5)
    a.embedded(300, t0, t0 + 0.9)
    a.embedded(200, t0 + 1.0, t0 + 2.5)
    a.batch(10, 90, 100)                 # bucket 16: 10% padding
    b.time("embed", 1.0)
    b.time("write", 0.25)
    b.embedded(500, t0 + 2.6, t0 + 4.0)
    b.batch(40, 150, 200)                # bucket 64: 25% padding
    b.batch(12, 40, 60)
    return [a.take(), b.take()]


def _manifest() -> dict:
    return {"model": {"name": "wikitext2-small"}, "run": {"key": "k1", "resumed_sentences": 0},
            "inputs": ["a.txt"], "formats": ["parquet"], "shards": [{}, {}],
            "counts": {"documents": 7, "sentences": 12, "sentences_written": 10, "tokens_written": 1000,
                       "dead_letters": 2, "dead_letters_by_reason": {"too long": 1, "no tokens": 1}}}


def test_stats_take_and_merge():
    parts = _stats()
    m = merge_stats(parts + [None, {}])
    assert m["seconds"] == {"embed": 3.0, "tokenize": 0.5, "write": 0.25}
    assert sum(m["tokens_at"].values()) == pytest.approx(1000) and len(m["tokens_at"]) == 4    # spread per second
    assert m["tokens_at"][1_700_000_001] == pytest.approx(200 / 1.5)
    assert m["padding"] == {16: [2, 130, 160], 64: [1, 150, 200]}
    assert m["span"] == [1_700_000_000.0, 1_700_000_004.0] and len(m["hosts"]) == 1
    assert json.loads(json.dumps(parts)) == parts           # JSON-ready, as staged
    s = RunStats()
    assert s.take() is None


def test_a_batch_with_no_measured_time_counts_once():
    """A batch whose end reads the same (a coarse clock) or an earlier time (a clock set back) than its start."""
    s = RunStats()
    s.embedded(100, 1_700_000_000.5, 1_700_000_000.5)
    s.embedded(50, 1_700_000_002.75, 1_700_000_002.25)
    assert s.take()["tokens_at"] == {"1700000000": 100, "1700000002": 50}


def test_report_numbers_and_sections():
    records = [{"lengths": {"3": 4, "5": 2}}, {"lengths": {"5": 3, "120": 1}}]
    d = report_data(_manifest(), records, _stats(), run_seconds=9.5)
    s = d["summary"]
    assert s["model"] == "wikitext2-small" and s["tokens_written"] == 1000 and s["dead_letters"] == 2
    assert s["tokens_embedded"] == 1000 and s["embedding_span_s"] == pytest.approx(4.0)
    assert s["tokens_per_s"] == pytest.approx(250.0) and s["tokens_per_embed_s"] == pytest.approx(1000 / 3.0)
    assert d["padding"]["fraction"] == pytest.approx(1 - 280 / 360)
    assert [(b["longest"], b["batches"]) for b in d["padding"]["buckets"]] == [(16, 2), (64, 1)]
    assert d["stages"] == {"read": 0.0, "tokenize": 0.5, "batch": 0.0, "embed": 3.0, "write": 0.25}
    assert d["lengths"]["sentences"] == 10 and sum(d["lengths"]["counts"]) == 10 and d["lengths"]["max"] == 120
    assert list(d["dead_letters"]) == ["too long", "no tokens"] or set(d["dead_letters"]) == {"too long", "no tokens"}
    page = build_report(_manifest(), records, _stats(), 9.5)
    for section in SECTIONS:
        assert f'id="{section}"' in page
    assert page.count("<svg") == 5 and "wikitext2-small" in page and "1,000" in page and "22.2%" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")    # self-contained: no fetch


def test_report_of_an_empty_run_and_escaping():
    m = {"model": {"name": "<b>x</b>"}, "counts": {"dead_letters_by_reason": {"bad <tag>": 3}}}
    page = build_report(m, [], [])
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "bad &lt;tag&gt;" in page and "<b>x</b>" not in page
    assert "No embedded batches" in page


def test_timeline_and_histogram_bins():
    tl = timeline({100: 10, 101: 30, 103: 20})
    assert tl["x"] == [0, 1, 2, 3] and tl["tokens_per_s"] == [10, 30, 0, 20] and tl["tokens"] == 60
    long = timeline({t: 1 for t in range(1000)})
    assert len(long["x"]) <= 120 and long["width"] == 9 and long["tokens"] == 1000
    h = length_histogram({n: 10 for n in range(1, 101)} | {5000: 1})     # a long tail: one last bin
    assert h["labels"][-1] == f"{h['p99'] + 1}-5000" and h["counts"][-1] == 1 and sum(h["counts"]) == 1001
    assert len(h["counts"]) <= 42 and h["median"] == 51
    assert length_histogram({1: 2})["labels"] == ["0", "1"]


def _batch():
    items = [Item(f"d:1#{i}", "d:1", i, tuple(f"t{k}" for k in range(n)), tuple((2 * k, 2 * k + 1) for k in range(n)))
             for i, n in enumerate((3, 1))]
    return EmbeddedBatch(items, np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4), np.array([0, 3, 4]))


def _stage(out):
    staging = out + "/_staging/run1"
    Staging(staging).shard([(_batch(), 0), (_batch(), 1)], SPEC)
    Staging(staging).counts("x", {"input_records": 1, "blank_records": 0})
    for part in _stats():
        Staging(staging).stats(part)
    return staging


def test_finalize_writes_the_report_beside_the_manifest(tmp_path):
    out = str(tmp_path / "out")
    staging = _stage(out)
    staged = finalize.plan_from_staging(staging, ["x"])
    assert staged.records[0]["lengths"] == {"1": 1, "3": 1} and len(staged.stats) == 2
    m = finalize.finalize(out, staging, staged, {"model": {"name": "tiny"}}, run_seconds=3.0)
    assert m["report"] == "report.html" == json.load(open(os.path.join(out, "manifest.json")))["report"]
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert "2 sentences written" in page and "tiny" in page


def test_a_rerun_of_an_interrupted_finalize_still_writes_it(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    staging = _stage(out)
    staged = finalize.plan_from_staging(staging, ["x"])
    with monkeypatch.context() as mp:       # killed right after writing the plan: nothing moved yet
        mp.setattr(finalize, "complete_finalize", lambda *a, **k: None)
        finalize.finalize(out, staging, staged, {})
    assert not os.path.exists(os.path.join(out, "report.html"))
    finalize.complete_finalize(out, staging)
    assert os.path.exists(os.path.join(out, "report.html")) and os.path.exists(os.path.join(out, "_SUCCESS"))
    assert os.path.exists(os.path.join(out, "metrics.prom"))
    ownership.clear_final(Sink(__import__("fsspec").filesystem("file")), out)
    assert not os.path.exists(os.path.join(out, "report.html"))        # a final name: cleared with the rest
    assert not os.path.exists(os.path.join(out, "metrics.prom"))


def test_a_report_that_fails_does_not_fail_the_run(tmp_path, monkeypatch, caplog):
    out = str(tmp_path / "out")
    staging = _stage(out)
    monkeypatch.setattr(finalize, "build_report", lambda *a: 1 / 0)
    m = finalize.finalize(out, staging, finalize.plan_from_staging(staging, ["x"]), {})
    assert "report" not in m and os.path.exists(os.path.join(out, "_SUCCESS"))
    assert "could not build the run report" in caplog.text


# ---------------------------------------------------------------- progress by input bytes
def test_percent_and_eta_from_bytes():
    buf = io.StringIO()
    bar = progress.ByteProgress(4096, "embedding", file=buf, mininterval=0)
    bar.update(1024, tokens=500)
    bar.bar.refresh()
    line = buf.getvalue().split("\r")[-1]
    assert " 25%" in line and "1.00k/4.00k" in line and "tok/s" in line
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", line), line          # elapsed < ETA
    bar.update(3072)
    bar.close()
    assert "100%" in buf.getvalue()


def test_bytes_split_over_sentences():
    assert progress.split_bytes(100, [10, 30, 40], 40) == [25, 50, 25]
    assert sum(progress.split_bytes(7, [1, 2, 3], 3)) == 7 and progress.split_bytes(5, [0], 0) == [5]
    assert progress.description(progress.ProgressSpec(10, {}, 2)).startswith("embedding, pid")


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz", "a.parquet"])
def test_documents_carry_the_bytes_of_the_stored_file(tmp_path, name):
    rng = np.random.default_rng(0)         # text that does not compress much: several blocks of a .gz file
    lines = [f"Document {i} has {rng.integers(1 << 62):x} {rng.integers(1 << 62):x} in it." for i in range(20000)]
    path = str(tmp_path / name)
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write("\n".join(lines) + "\n")
    elif name.endswith(".parquet"):
        pq.write_table(pa.table({"text": lines}), path)
    else:
        open(path, "w").write("\n".join(lines) + "\n")
    docs = list(read_documents(path, "parquet" if name.endswith("parquet") else "text", "a"))
    assert len(docs) == 20000 and sum(d.nbytes for d in docs) == os.path.getsize(path)
    assert sum(1 for d in docs if d.nbytes) > 1          # spread over the file, not all at its end
    assert docs[0] == Document("a:1", lines[0])            # not content: equality ignores it


def test_tokenize_splits_a_documents_bytes_over_its_items():
    from elmo_pipeline.transforms.tokenize_step import Tokenize
    t = Tokenize("wikitext", 1000, progress=progress.ProgressSpec(1000))
    t.setup()
    t.run_stats.reset()
    items = list(t.process(Document("d", "First one here . Second one , longer than the first .", nbytes=90)))
    assert len(items) == 2 and sum(i.nbytes for i in items) == 90 and 0 < items[0].nbytes < items[1].nbytes
    assert t.run_stats.take()["seconds"]["tokenize"] > 0


# ---------------------------------------------------------------- a whole run
def test_a_run_writes_its_report(tmp_path, tiny_model_files, capfd):
    from tests.pipeline_helpers import run_pipeline
    from tests.resume_helpers import write_corpus
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=30)
    out = str(tmp_path / "out")
    with open(corpus, "a") as f:
        f.write("word " * 80 + "\n")                       # one sentence over the limit below: a dead letter
    _, m = run_pipeline(tiny_model_files, corpus, out, "--shard-sentences", "10", "--max-tokens-per-batch", "256",
                        "--max-sentence-tokens", "60", "--progress", "on")
    err = capfd.readouterr().err
    assert "100%" in err and "tok/s" in err and f"{os.path.getsize(corpus) / 1024:.2f}k" in err
    assert m["report"] == "report.html" and os.path.exists(os.path.join(out, "report.html"))
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    c = m["counts"]
    assert c["dead_letters_by_reason"] == {"too long": 1}
    for n in (c["documents"], c["sentences"], c["tokens_written"]):
        assert f"<td>{n:,}</td>" in page
    assert f"{c['sentences_written']:,} sentences written" in page and "too long" in page
    for section in SECTIONS:
        assert f'id="{section}"' in page
