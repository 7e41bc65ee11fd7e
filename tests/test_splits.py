"""Reads below the file (pipeline/read_plan.py, transforms/splits.py): a file read in parts, whatever their size, gives exactly the
records of the file read whole (ids, texts, blanks, dead letters), and a run with tiny parts writes what a run
reading whole files writes; killed mid-run and rerun, it stays exact."""
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from elmo_pipeline.transforms.read import read_documents
from elmo_pipeline.pipeline.read_plan import line_cuts, plan_splits, split_size
from elmo_pipeline.transforms.splits import Split
from tests import robustness_corpus as rc
from tests.resume_helpers import argv, assert_same_output, read_output, run_subprocess, write_corpus

CASES = rc.generated_cases()


def _file(tmp_path_factory, name, data: bytes) -> str:
    path = str(tmp_path_factory.mktemp("f") / name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _jsonl() -> bytes:
    rows = [json.dumps({"id": f"d{i}", "text": f"Document {i} says hello . Again ."}) for i in range(40)]
    rows[5], rows[9], rows[17] = '{"id": "x", "text": ', '{"id": "blank", "text": "  "}', '{"id": 1.5, "text": "a"}'
    return ("\n".join(rows) + "\r\n\n" + json.dumps({"text": "caf\u00e9 " * 80}) + "\n").encode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(path, format, id field) of dirty text and JSONL files, each several lines long."""
    text = b"".join(CASES[n] + (b"" if CASES[n].endswith(b"\n") else b"\n") for n in
                    ("crlf.txt", "nul.txt", "invalid_utf8.txt", "controls.txt", "blank_lines.txt", "long_tokens.txt"))
    out = [(_file(tmp_path_factory, "bom.txt", CASES["bom.txt"] + text), "text", None),
           (_file(tmp_path_factory, "dirty.txt", text + b"no newline at the end"), "text", None),
           (_file(tmp_path_factory, "lines.txt", text * 3), "lines", None),
           (_file(tmp_path_factory, "utf16.txt", "\ufeffa\nb\n".encode("utf-16")), "text", None),
           (_file(tmp_path_factory, "cr.txt", b"first\rsecond\rthird" * 30 + b"\nlast\n"), "text", None),
           (_file(tmp_path_factory, "docs.jsonl", _jsonl()), "jsonl", None),
           (_file(tmp_path_factory, "ids.jsonl", _jsonl()), "jsonl", "id")]
    return out


def _records(path, fmt, id_field, cap, split=None):
    return list(read_documents(path, fmt, "f", "text", id_field, None, cap, split))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 600), cap=st.sampled_from([40, 8 << 20]), which=st.integers(0, 6))
def test_parts_read_as_the_whole_file(files, size, cap, which):
    """Any split size, any --max-record-bytes: the parts' records, in order, are the whole file's."""
    path, fmt, id_field = files[which]
    whole = _records(path, fmt, id_field, cap)
    splits = plan_splits([path], {path: os.path.getsize(path)}, fmt, size)
    parts = [r for s in splits for r in _records(path, fmt, id_field, cap, s)]
    assert parts == whole
    assert [s.part for s in splits] == list(range(len(splits))) and {s.parts for s in splits} == {len(splits)}


def test_cuts_at_line_starts(files):
    path = files[1][0]
    data = open(path, "rb").read()
    cuts = line_cuts(path, 50)
    assert len(cuts) > 3 and cuts[0][:1] == (0,) and cuts[-1][1] == len(data)
    for (a, b, first), nxt in zip(cuts, cuts[1:] + [(len(data),)]):
        assert b == nxt[0] and (a == 0 or data[a - 1:a] == b"\n") and first == data[:a].count(b"\n") + 1
    # a first line that fails the file-level check (UTF-16, CR line ends): the file is one part, refused whole
    assert line_cuts(files[3][0], 1) == [(0, -1, 1)] and line_cuts(files[4][0], 1) == [(0, -1, 1)]


def test_parquet_parts_are_row_groups(tmp_path):
    texts = [f"Row {i} text ." if i % 7 else " " for i in range(300)]
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": texts, "id": [f"r{i}" for i in range(300)]}), path, row_group_size=16)
    whole = _records(path, "parquet", None, 8 << 20)
    for size in (1, 500, 3000):
        splits = plan_splits([path], {path: os.path.getsize(path)}, "parquet", size)
        assert len(splits) > 1 and splits[-1].end == 19
        assert [r for s in splits for r in _records(path, "parquet", None, 8 << 20, s)] == whole
    gz = str(tmp_path / "t.txt.gz")
    open(gz, "wb").write(b"\x1f\x8b")
    assert plan_splits([gz, path], {gz: 10 ** 9, path: 10}, "text", 100) == [Split(0), Split(1)]


def test_split_size_from_the_corpus():
    assert split_size(0, 10 << 30) == 64 << 20 and split_size(0, 1 << 20) == 64 << 10
    assert split_size(0, 100 << 20) == (100 << 20) // 64
    assert split_size(1000, 1 << 30) == 1000 and split_size(-1, 1 << 30) == 0


EXTRA = ("--shard-sentences", "8", "--max-tokens-per-batch", "256", "--max-sentence-tokens", "24",
         "--batch-invariant", "--max-record-bytes", "300")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One file of 120 documents, dirty lines among them, several KB: many parts at --split-bytes 97."""
    folder = tmp_path_factory.mktemp("one")
    path = write_corpus(str(folder / "docs.txt"), n_docs=120, seed=5)
    with open(path, "ab") as f:
        f.write(CASES["invalid_utf8.txt"] + b"\n" + CASES["blank_lines.txt"] + CASES["long_tokens.txt"]
                + b"one more line.\n")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:             # dirty lines in the middle too
        f.write(data[:3000].rsplit(b"\n", 1)[0] + b"\n" + CASES["nul.txt"] + data[len(data[:3000].rsplit(b"\n", 1)[0]) + 1:])
    return path


@pytest.fixture(scope="module")
def whole(corpus, tiny_model_files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("whole") / "out")
    p = run_subprocess(argv(tiny_model_files, corpus, out, *EXTRA, "--split-bytes", "-1"))
    assert p.returncode == 0, p.stderr[-3000:]
    ref = read_output(out)
    c = ref[0]["counts"]
    assert c["record_dead_letters"] >= 5 and c["blank_records"] >= 5 and c["documents"] > 80
    return ref


@pytest.mark.slow
def test_tiny_parts_equal_whole_files(corpus, tiny_model_files, whole, tmp_path):
    """--split-bytes 97 (about 100 parts of one file) writes what reading the file whole writes, bit for bit
    (--batch-invariant): ids, tokens, offsets, vectors, counts, dead letters."""
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *EXTRA, "--split-bytes", "97")
    assert len(plan(pipeline_options(args)).splits) > 50
    p = run_subprocess(args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_output(read_output(out), whole, tol=0.0)


@pytest.mark.slow
def test_tiny_parts_killed_then_rerun(corpus, tiny_model_files, whole, tmp_path):
    """SIGKILLed while embedding (shards of some parts committed), then rerun: the same output."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *EXTRA, "--split-bytes", "97")
    p = run_subprocess(args, "embed:3")
    assert p.returncode == -9, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    p = run_subprocess(args)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_output(out)
    assert got[0]["run"]["resumed_shards"] > 0
    assert_same_output(got, whole, tol=0.0)


def test_finalize_needs_the_counts_of_every_part(tmp_path):
    """A file read in parts is counted once every part's counts are staged, summed; a missing part is Incomplete."""
    from elmo_pipeline.output.finalize import Incomplete, plan_from_staging
    from elmo_pipeline.output.staging import Staging
    st = str(tmp_path / "_staging" / "k")
    staging = Staging(st)
    staging.counts("a.txt", {"input_records": 3, "blank_records": 1}, (0, 3))
    staging.counts("a.txt", {"input_records": 4, "blank_records": 0}, (2, 3))
    staging.counts("b.txt", {"input_records": 5, "blank_records": 2})
    with pytest.raises(Incomplete, match="1 input file"):
        plan_from_staging(st, ["a.txt", "b.txt"])
    staging.counts("a.txt", {"input_records": 1, "blank_records": 1}, (1, 3))
    staging.counts("a.txt", {"input_records": 1, "blank_records": 1}, (1, 3))      # a retried part: same name
    assert plan_from_staging(st, ["a.txt", "b.txt"]).counts == {"input_records": 13, "blank_records": 4}


def test_auto_split_where_work_is_spread(corpus, tiny_model_files, tmp_path):
    """Auto (--split-bytes 0): one local worker reads files whole (its output as before); 2 worker processes
    read the file in parts of 64 KiB at least; --state stateful with --split-bytes is refused."""
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    big = str(tmp_path / "big.txt")
    with open(corpus, "rb") as src, open(big, "wb") as f:
        f.write(src.read() * 40)
    args = argv(tiny_model_files, big, str(tmp_path / "out"))
    assert len(plan(pipeline_options(args)).splits) == 1
    multi = plan(pipeline_options(args + ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]))
    assert abs(len(multi.splits) - os.path.getsize(big) / (64 << 10)) <= 1 and multi.spread_buckets == 0
    with pytest.raises(ValueError, match="--split-bytes needs"):
        plan(pipeline_options(args + ["--state", "stateful", "--split-bytes", "100"]))


def test_an_input_replaced_between_planning_and_reading_fails_at_once(tmp_path, tiny_model_files):
    """--split-bytes: the file replaced after planning (another size and mtime) is read against the planned
    fingerprint: InputChanged, one line, exit 65 (fix the data), before any of it is read; never rounds of
    'not a whole commit record'."""
    from elmo_pipeline.pipeline.execute import run_planned
    from elmo_pipeline.pipeline.exits import DATA, classify
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"line {i} of the corpus is here .\n" for i in range(200)), encoding="utf-8")
    options, weights = tiny_model_files
    opts = pipeline_options(["--input", str(inp), "--output", str(tmp_path / "out"), "--options-file", options,
                             "--weight-file", weights, "--split-bytes", "2000", "--torch-threads", "1",
                             "--progress", "off", "--tokenizer", "whitespace"])
    pl = plan(opts)
    assert len(pl.splits) > 1
    inp.write_text("".join(f"another line {i} .\n" for i in range(150)), encoding="utf-8")
    os.utime(inp, (1, 1))
    with pytest.raises(Exception) as e:
        run_planned(opts, pl)
    failure = classify(e.value)
    assert failure.status == DATA and "changed since the run was planned" in failure.line(), failure.line()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_input_that_changes_while_it_is_read_is_refused_not_mixed(tmp_path, tiny_model_files, monkeypatch):
    """A file appended to (or rewritten in place) while a read element reads it: InputChanged, one line, exit 65,
    no manifest; never an output of exit 0 holding lines of a version of the file the run was not planned with
    (red team: 100 lines appended as the run read the file were embedded, exit 0, the run key the old file's)."""
    from elmo_pipeline.pipeline.execute import run_planned
    from elmo_pipeline.pipeline.exits import DATA, classify
    from elmo_pipeline.pipeline.plan import pipeline_options, plan
    from elmo_pipeline.transforms import read_step
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"line {i} of the corpus is here .\n" for i in range(200)), encoding="utf-8")
    options, weights = tiny_model_files
    args = ["--input", str(inp), "--output", str(tmp_path / "out"), "--options-file", options, "--weight-file",
            weights, "--torch-threads", "1", "--progress", "off", "--tokenizer", "whitespace"]
    opts = pipeline_options(args)
    pl = plan(opts)
    read = read_step.read_documents

    def appended_while_read(*a, **k):       # the writer appends once the reader has taken the first record
        for n, rec in enumerate(read(*a, **k)):
            if n == 0 and not getattr(appended_while_read, "done", False):
                appended_while_read.done = True
                with open(inp, "a", encoding="utf-8") as f:
                    f.write("".join(f"zebra appended line {i} .\n" for i in range(50)))
            yield rec
    monkeypatch.setattr(read_step, "read_documents", appended_while_read)
    with pytest.raises(Exception) as e:
        run_planned(opts, pl)
    failure = classify(e.value)
    assert failure.status == DATA and "changed since the run was planned" in failure.line(), failure.line()
    assert not (tmp_path / "out" / "manifest.json").exists()
