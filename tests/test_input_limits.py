"""Limits hold for every layout and command: --max-record-bytes and the memory bound for dictionary-encoded and plain
Parquet, `plan` reading with the run's readers and bounds (duplicate ids included), files that are not UTF-8
text with LF or CRLF line ends refused whole, and the `elmo` command's one `error:` line before embedding."""
import gzip
import io
import json
import os
import re
import subprocess
import sys

import h5py
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmo_pipeline.pipeline.cli import main as cli
from elmo_pipeline.pipeline.dry_run import estimate
from elmo_pipeline.pipeline.run import main
from elmo_pipeline.transforms.read import read_documents
from tests.pipeline_helpers import parquet_rows
from tests.resume_helpers import REPO, argv
from tests.test_hostile_records import _finished
from tests.test_model_file_schema import RUN_AND_REPORT_PEAK

BOUND = 12          # docs/failure-behaviour.md: a run's peak RSS grows by at most about 12x --max-record-bytes
SLACK = 40 << 20    # allocator and import noise between two processes


def _peak(args: list[str], tmp_path, name: str) -> tuple[int, int]:
    """(exit status, peak resident bytes) of `python -m elmo_pipeline.pipeline.run ARGS` in its own process."""
    peak_file = str(tmp_path / f"{name}.peak")
    p = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_PEAK, peak_file, *args], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=300)
    with open(peak_file) as f:
        return p.returncode, int(f.read()) * 1024


def _parquet_peaks(tmp_path, tiny_model_files) -> tuple[dict, str]:
    """({name: peak resident bytes} of runs on tmp_path/base.parquet and tmp_path/huge.parquet, each ending with
    status 0; the huge run's output)."""
    peaks = {}
    for name in ("base", "huge"):
        out = str(tmp_path / f"out-{name}")
        rc, peaks[name] = _peak(argv(tiny_model_files, str(tmp_path / f"{name}.parquet"), out, "--input-format",
                                     "parquet"), tmp_path, name)
        assert rc == 0
    return peaks, out


def _dictionary_parquet(path, values: list, arrow_schema: bool) -> None:
    """A Parquet file whose text column is dictionary-encoded; without the Arrow schema a reader sees plain
    strings unless it asks for the dictionary."""
    pq.write_table(pa.table({"text": pa.array(values).dictionary_encode()}), path, store_schema=arrow_schema,
                   compression="zstd")


def test_dictionary_encoded_parquet_cells_over_the_cap_are_dead_letters(tmp_path):
    path = str(tmp_path / "d.parquet")
    _dictionary_parquet(path, ["sixteen bytes ok"] * 3 + ["short ok", None], arrow_schema=True)
    recs = list(read_documents(path, "parquet", "d.parquet", max_record_bytes=10))
    assert [(type(r).__name__, getattr(r, "reason", getattr(r, "text", None))) for r in recs] == \
        [("DeadLetter", "too long: record of 16 bytes > --max-record-bytes 10")] * 3 + \
        [("Document", "short ok"), ("DeadLetter", "unreadable record: 'text' is null")]


@pytest.mark.parametrize("dictionary", [True, False])
def test_a_parquet_id_cell_over_the_cap_is_a_dead_letter(tmp_path, dictionary):
    ids = pa.array(["an id of 16 byte", "ok", "an id of 16 byte"])
    pq.write_table(pa.table({"text": ["One.", "Two.", "Three."], "id": ids.dictionary_encode() if dictionary else ids}),
                   tmp_path / "i.parquet")
    recs = list(read_documents(str(tmp_path / "i.parquet"), "parquet", "i.parquet", id_field="id", max_record_bytes=10))
    assert [(r.id, r.reason) if hasattr(r, "reason") else r.doc_id for r in recs] == [
        ("i.parquet:1", "too long: id 'id' of 16 bytes > --max-record-bytes 10"), "ok",
        ("i.parquet:3", "too long: id 'id' of 16 bytes > --max-record-bytes 10")]


@pytest.mark.parametrize("column", ["text", "id"])
def test_a_parquet_row_group_with_a_page_over_4x_the_cap_is_dead_letters_unread(tmp_path, column):
    """A plain page over 4x --max-record-bytes is never decoded: its row group's rows are record dead letters
    numbered as the run numbers rows; the other row groups read as before (a cell over the cap in a page
    within the limit stays its own "too long: record" dead letter)."""
    texts = [f"Row {i} here." for i in range(9)]
    ids = [f"id{i}" for i in range(9)]
    (texts if column == "text" else ids)[4] = "x" * 5000
    texts[7] = "y" * 1500
    pq.write_table(pa.table({"text": texts, "id": ids}), tmp_path / "p.parquet", use_dictionary=False,
                   compression="zstd", row_group_size=3)
    recs = list(read_documents(str(tmp_path / "p.parquet"), "parquet", "p.parquet", id_field="id",
                               max_record_bytes=1000))
    assert [r.doc_id for r in recs[:3] + recs[6:7] + recs[8:]] == ["id0", "id1", "id2", "id6", "id8"]
    assert [r.id for r in recs[3:6]] == ["p.parquet:4", "p.parquet:5", "p.parquet:6"]
    [reason] = {r.reason for r in recs[3:6]}
    assert re.fullmatch(r"too long: Parquet page of 50\d\d bytes > 4x --max-record-bytes 1000 "
                        rf"\(column '{column}', row group 1\); the row group is not read \(a larger --max-record-bytes reads it\)", reason), reason
    assert (recs[7].id, recs[7].reason) == ("id7", "too long: record of 1500 bytes > --max-record-bytes 1000")


@pytest.mark.slow
def test_a_huge_plain_parquet_cell_stays_within_the_memory_bound(tmp_path, tiny_model_files):
    """One 200 MiB cell of a plain (not dictionary-encoded) text column, in a file of a few KB: its row group is
    record dead letters, never decompressed, the other rows documents (in `plan` too), and memory no more than
    the documented bound over the same run without it."""
    rows = [f"Row {i} is fine ." for i in range(30)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "base.parquet", use_dictionary=False, compression="zstd",
                   row_group_size=10)
    pq.write_table(pa.table({"text": rows[:15] + ["a" * (200 << 20)] + rows[15:]}), tmp_path / "huge.parquet",
                   use_dictionary=False, compression="zstd", row_group_size=10)
    assert os.path.getsize(tmp_path / "huge.parquet") < 100_000
    peaks, out = _parquet_peaks(tmp_path, tiny_model_files)
    assert peaks["huge"] - peaks["base"] <= BOUND * (8 << 20) + SLACK, peaks
    m, dead = _finished(out)
    assert m["counts"]["documents"] == 21 and m["counts"]["record_dead_letters"] == 10, m["counts"]
    assert sorted(dead) == [f"huge.parquet:{i}" for i in range(11, 21)]
    [reason] = {d["reason"] for d in dead.values()}
    size = re.fullmatch(r"too long: Parquet page of (\d+) bytes > 4x --max-record-bytes 8388608 \(column 'text', "
                        r"row group 1\); the row group is not read \(a larger --max-record-bytes reads it\)", reason)
    assert size and (200 << 20) < int(size[1]) < (201 << 20), reason
    plan = estimate(argv(tiny_model_files, str(tmp_path / "huge.parquet"), str(tmp_path / "plan-out"),
                         "--input-format", "parquet"))
    for k in ("input_records", "record_dead_letters", "documents"):       # plan reads with the run's reader
        assert plan["estimated"][k] == m["counts"][k], k


@pytest.mark.slow
def test_a_dictionary_encoded_huge_value_stays_within_the_memory_bound(tmp_path, tiny_model_files):
    """100 rows of one value of --max-record-bytes + 1 bytes in a file of a few hundred bytes: each row a dead
    letter, and memory no more than the documented bound over the same run without them."""
    huge = "a" * ((8 << 20) + 1)
    _dictionary_parquet(tmp_path / "base.parquet", ["Fine.", "Also fine."], arrow_schema=False)
    _dictionary_parquet(tmp_path / "huge.parquet", ["Fine."] + [huge] * 100 + ["Also fine."], arrow_schema=False)
    assert os.path.getsize(tmp_path / "huge.parquet") < 10_000
    peaks, out = _parquet_peaks(tmp_path, tiny_model_files)
    m, dead = _finished(out)
    assert m["counts"]["documents"] == 2 and len(dead) == 100
    assert {d["reason"] for d in dead.values()} == {"too long: record of 8388609 bytes > --max-record-bytes 8388608"}
    assert peaks["huge"] - peaks["base"] <= BOUND * (8 << 20) + SLACK, peaks


@pytest.mark.slow
def test_files_not_utf8_with_lf_or_crlf_line_ends_are_refused_whole(tmp_path, tiny_model_files):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "u16.txt").write_bytes("Hello there .\nSecond line .\n".encode("utf-16"))
    (tmp_path / "in" / "cr.txt").write_bytes(b"Hello there .\rSecond line .\r")
    (tmp_path / "in" / "good.txt").write_bytes(b"\xef\xbb\xbfHello there .\r\nSecond line .\r\n")   # BOM, CRLF: fine
    out = str(tmp_path / "out")
    assert main(argv(tiny_model_files, str(tmp_path / "in" / "*.txt"), out)) == 0
    m, dead = _finished(out)
    assert dead["u16.txt:1"]["reason"].startswith("unreadable file: UTF-16LE text (byte-order mark FF FE)")
    assert dead["cr.txt:1"]["reason"].startswith("unreadable file: CR (\\r) line ends")
    assert len(dead) == 2 and sorted(parquet_rows(out, m)) == ["good.txt:1#0", "good.txt:2#0"]


@pytest.mark.slow
def test_plan_counts_duplicate_ids_as_the_run_does(tmp_path, tiny_model_files):
    inp = tmp_path / "d.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                           for i, t in [("a", "One here ."), ("a", "Two here ."), ("b", "Three here .")]))
    args = argv(tiny_model_files, str(inp), str(tmp_path / "out"), "--input-format", "jsonl", "--id-field", "id")
    plan = estimate(args)
    assert main(args) == 0
    m, dead = _finished(str(tmp_path / "out"))
    assert sorted(dead) == ["d.jsonl:1", "d.jsonl:2"]
    for k in ("input_records", "record_dead_letters", "documents", "tokens_written"):
        assert plan["estimated"][k] == m["counts"][k], k


@pytest.mark.slow
def test_plan_applies_max_record_bytes_to_a_long_line(tmp_path, tiny_model_files):
    """A line over --max-record-bytes in an uncompressed file sampled by windows is a record dead letter, as in
    the run, not a document tokenized whole."""
    inp = tmp_path / "long.txt"
    inp.write_bytes(b"Fine here .\n" + b"a " * (1 << 20) + b"\n" + b"Also fine .\n" * 8000)
    plan = estimate(argv(tiny_model_files, str(inp), str(tmp_path / "out"), "--max-record-bytes", "100000"),
                    sample_bytes=64 << 10)
    assert plan["sample"]["record_dead_letters"] == 1 and plan["sample"]["dead_letter_sentences"] == 0, plan["sample"]


@pytest.mark.slow
def test_plan_memory_on_a_gz_of_newlines_stays_as_the_runs(tmp_path, tiny_model_files):
    """A few KB of .gz that expand to millions of blank lines: plan counts them as it reads (the run's reader),
    holding none, so its peak is that of a plan of two good lines."""
    (tmp_path / "base").mkdir()
    (tmp_path / "in").mkdir()
    for d in ("base", "in"):
        (tmp_path / d / "good.txt").write_text("The cat sat on the mat .\nA dog ran .\n")
    with gzip.open(tmp_path / "in" / "newlines.txt.gz", "wb") as f:
        f.write(b"\n" * (2 << 20))
    peaks = {}
    for d in ("base", "in"):
        rc, peaks[d] = _peak(["--dry-run", *argv(tiny_model_files, str(tmp_path / d / "*"), str(tmp_path / "out"))],
                             tmp_path, d)
        assert rc == 0
    assert peaks["in"] - peaks["base"] <= SLACK, peaks


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60).map(lambda b: bytes(c % 3 + 10 if c % 2 else 97 for c in b)),
       st.integers(0, 60), st.integers(0, 60), st.integers(1, 7))
def test_plan_window_is_the_lines_starting_in_it(data, a, b, block):
    from elmo_pipeline.pipeline.sample import _window
    start, end = min(a, b, len(data)), min(max(a, b), len(data))
    starts = [q for q in range(start, end) if q == 0 or data[q - 1] == 10]
    want = b""
    if starts:
        stop = data.find(b"\n", end - 1)
        want = data[starts[0]:len(data) if stop < 0 else stop + 1]
    w = _window(io.BytesIO(data), start, end, block)
    assert b"".join(iter(w.read, b"")) == want


ELMO_INPUTS = {   # (input bytes, flags, the error line's start)
    "invalid UTF-8": (b"good line .\nbad \xff here\n", [],
                      "error: INPUT_FILE line 2: invalid UTF-8: invalid start byte at byte 4 of the line"),
    "UTF-16": ("a b\nc d\n".encode("utf-16"), [], "error: INPUT_FILE line 1: unreadable file: UTF-16LE text"),
    "CR line ends": (b"a b\rc d\r", [], "error: INPUT_FILE line 1: unreadable file: CR (\\r) line ends"),
    "a line over the cap": (b"a b\n" + b"x" * ((8 << 20) + 1) + b"\n", [],
                            "error: INPUT_FILE line 2: too long: record of 8388609 bytes"),
    "key '.'": (b"a b\n.\n", ["--use-sentence-keys"], "error: --use-sentence-keys needs unique"),
    "key with NUL": (b"a\0b\nc\n", ["--use-sentence-keys"], "error: --use-sentence-keys needs unique"),
}


@pytest.mark.parametrize("case", list(ELMO_INPUTS))
def test_elmo_command_refuses_bad_input_before_embedding(tmp_path, tiny_model_files, case):
    data, flags, error = ELMO_INPUTS[case]
    (tmp_path / "in.txt").write_bytes(data)
    out = tmp_path / "out.hdf5"
    with pytest.raises(SystemExit) as e:
        cli(["elmo", str(tmp_path / "in.txt"), str(out), "--top", *flags, "--options-file", tiny_model_files[0],
             "--weight-file", tiny_model_files[1]])
    assert str(e.value.code).startswith(error) and "\n" not in str(e.value.code), e.value.code
    assert not out.exists()


def test_elmo_command_keys_are_the_lines_without_bom_and_crlf(tmp_path, tiny_model_files):
    (tmp_path / "in.txt").write_bytes(b"\xef\xbb\xbfThe cat .\r\nA dog ran .\r\n")
    out = tmp_path / "out.hdf5"
    assert cli(["elmo", str(tmp_path / "in.txt"), str(out), "--top", "--use-sentence-keys", "--options-file",
                tiny_model_files[0], "--weight-file", tiny_model_files[1]]) == 0
    with h5py.File(out, "r") as f:
        assert sorted(f.keys()) == ["A dog ran .", "The cat .", "sentence_to_index"]
        assert json.loads(f["sentence_to_index"][0]) == {"The cat .": "0", "A dog ran .": "1"}


def _varint(n: int, width: int = 0) -> bytes:
    """n as a Thrift compact varint, padded with continuation bytes to `width` bytes (readers accept them)."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
        if not n and len(out) >= width:
            break
    out[-1] &= 0x7F
    return bytes(out)


def _lie_about_uncompressed_sizes(path) -> None:
    """Rewrite the footer of the Parquet file at `path` in place so that every column chunk claims 1 byte
    uncompressed (ColumnMetaData field 6, each value re-encoded in its own width: the footer's length holds)."""
    md = pq.ParquetFile(path).metadata
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            honest = _varint(md.row_group(g).column(c).total_uncompressed_size * 2)     # zigzag
            at = data.find(b"\x16" + honest, start)
            assert at > 0
            data[at + 1:at + 1 + len(honest)] = _varint(2, len(honest))
            start = at + 1 + len(honest)
    with open(path, "wb") as f:
        f.write(data)
    assert {pq.ParquetFile(path).metadata.row_group(g).column(c).total_uncompressed_size
            for g in range(md.num_row_groups) for c in range(md.num_columns)} == {1}


def test_a_footer_that_understates_a_page_does_not_get_it_decoded(tmp_path):
    """The page guard reads the pages' own headers (the sizes pyarrow decompresses), not the footer's totals: a
    footer claiming 1 byte a column chunk still gets the row group with a 5,000-byte page left unread."""
    texts = [f"Row {i} here." for i in range(6)]
    texts[4] = "x" * 5000
    path = tmp_path / "lie.parquet"
    pq.write_table(pa.table({"text": texts}), path, use_dictionary=False, compression="zstd", row_group_size=3)
    _lie_about_uncompressed_sizes(path)
    recs = list(read_documents(str(path), "parquet", "lie.parquet", max_record_bytes=1000))
    assert [r.text for r in recs[:3]] == texts[:3]
    assert [r.id for r in recs[3:]] == ["lie.parquet:4", "lie.parquet:5", "lie.parquet:6"]
    [reason] = {r.reason for r in recs[3:]}
    assert re.match(r"too long: Parquet page of 50\d\d bytes > 4x --max-record-bytes 1000 \(column 'text', row group 1\)",
                    reason), reason


def test_a_text_column_of_lists_is_never_decoded(tmp_path, monkeypatch):
    """A text column of lists of strings (not text: each row a dead letter by its type) is never decoded, however
    many values its pages hold: one row of 2,000,000 dictionary-encoded strings (a file of a few hundred bytes)
    reads no page of it, and neither does a page over the guard."""
    import elmo_pipeline.transforms.read as read
    n = 2_000_000
    big = pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.array(["ab"]).take(pa.array([0] * n)))
    pq.write_table(pa.table({"text": big}), tmp_path / "bomb.parquet", compression="zstd")
    pq.write_table(pa.table({"text": [["a"], ["x" * 5000], ["b"]]}), tmp_path / "lists.parquet",
                   use_dictionary=False)
    assert os.path.getsize(tmp_path / "bomb.parquet") < 2000
    monkeypatch.setattr(read, "column_pages", lambda *a: pytest.fail("a page header of a list column was read"))
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("values decoded"))
    reason = "unreadable record: 'text' is list<element: string>, not a string"
    for name, rows in (("bomb.parquet", 1), ("lists.parquet", 3)):
        recs = list(read_documents(str(tmp_path / name), "parquet", name, max_record_bytes=1000))
        assert [(r.id, r.reason, r.excerpt) for r in recs] == [(f"{name}:{i}", reason, "") for i in range(1, rows + 1)]


def test_an_id_column_of_another_type_is_a_bad_id_per_row_never_decoded(tmp_path, monkeypatch):
    """An --id-field column that is neither text nor integers (a list, a float, a struct) makes each row a dead
    letter "bad id" by its type, no value read; a text column of another type with good ids keeps each row's id."""
    import elmo_pipeline.transforms.read as read
    pq.write_table(pa.table({"text": ["One.", "Two."], "id": [["a"], ["b"] * 1000], "f": [1.0, 2.0],
                             "k": [3, 4], "n": [[1], [2]]}), tmp_path / "t.parquet")
    calls = []
    monkeypatch.setattr(read, "_texts_within", lambda column, cap: calls.append(column.type) or
                        (column.to_pylist(), [None] * len(column)))
    for field, what in (("id", "list<element: string>"), ("f", "double")):
        recs = list(read_documents(str(tmp_path / "t.parquet"), "parquet", "t.parquet", id_field=field))
        assert [(r.id, r.reason) for r in recs] == [
            (f"t.parquet:{i}", f"bad id: {field!r} is {what}, not a string or an integer") for i in (1, 2)]
    assert calls == []
    recs = list(read_documents(str(tmp_path / "t.parquet"), "parquet", "t.parquet", "n", id_field="k"))
    assert [(r.id, r.reason) for r in recs] == [
        (k, "unreadable record: 'n' is list<element: int64>, not a string") for k in ("3", "4")]
    assert calls == [pa.int64()]


def test_a_batch_of_rows_holds_about_batch_bytes_at_the_densest_page(tmp_path, monkeypatch):
    """Rows per batch follow the densest page of a row group, not its average: 100 values of 100 KB among 10,000
    short rows (average about 1 KB a row) never come out more than one page over BATCH_BYTES (1 MiB here) in
    one batch."""
    texts = [f"Row {i}." for i in range(10_000)]
    for i in range(100):
        texts[5_000 + i] = "y" * 100_000
    path = tmp_path / "skew.parquet"
    pq.write_table(pa.table({"text": texts}), path, use_dictionary=False, data_page_size=1 << 12, write_batch_size=1,
                   row_group_size=10_000)
    _read_within_a_mib(path, texts, monkeypatch)


def test_row_groups_of_no_rows_are_read_as_nothing(tmp_path):
    """pyarrow writes a row group of no rows (an empty write, an empty partition) with page offsets 0 and 4: it is
    passed over, never walked for page headers; the file's other rows read, and a file of one empty group is no
    record."""
    t = pa.table({"text": ["The cat sat.", "A dog ran."]})
    with pq.ParquetWriter(tmp_path / "mid.parquet", t.schema) as w:
        w.write_table(t)
        w.write_table(t.slice(0, 0))
        w.write_table(t)
    assert pq.ParquetFile(tmp_path / "mid.parquet").metadata.row_group(1).num_rows == 0
    recs = list(read_documents(str(tmp_path / "mid.parquet"), "parquet", "mid.parquet"))
    assert [(type(r).__name__, r.text) for r in recs] == [("Document", s) for s in t.column("text").to_pylist() * 2]
    pq.write_table(t.slice(0, 0), tmp_path / "empty.parquet")
    assert list(read_documents(str(tmp_path / "empty.parquet"), "parquet", "empty.parquet")) == []


def test_a_v2_page_header_that_overstates_its_rows_does_not_grow_the_batch(tmp_path, monkeypatch):
    """A v2 data page's num_rows is not checked by readers (its num_values is): rows per batch follow num_values,
    so a header claiming 63 rows for a page of one 100 KB value leaves batches within BATCH_BYTES (1 MiB here)."""
    texts = ["z" * 100_000 for _ in range(60)]
    path = tmp_path / "v2.parquet"
    pq.write_table(pa.table({"text": texts}), path, use_dictionary=False, data_page_version="2.0",
                   data_page_size=1 << 10, write_batch_size=1, compression="none")
    data = bytearray(path.read_bytes())
    # PageHeader field 8 (DataPageHeaderV2, a struct: 0x5c after field 3) opens with num_values, num_nulls,
    # num_rows: 1, 0, 1 (zigzag varints)
    marker = b"\x5c\x15\x02\x15\x00\x15\x02"
    assert data.count(marker) == 60
    data = data.replace(marker, b"\x5c\x15\x02\x15\x00\x15\x7e")        # num_rows 63
    path.write_bytes(bytes(data))
    _read_within_a_mib(path, texts, monkeypatch)


def _read_within_a_mib(path, texts: list[str], monkeypatch) -> None:
    """Read `path` with BATCH_BYTES 1 MiB: its rows are `texts`, and no batch of the text column decoded is more
    than that, one 100 KB value and the offsets over it."""
    import elmo_pipeline.transforms.read as read
    monkeypatch.setattr(read, "BATCH_BYTES", 1 << 20)
    seen, texts_within = [], read._texts_within
    monkeypatch.setattr(read, "_texts_within", lambda column, cap: (seen.append(column.nbytes), texts_within(column, cap))[1])
    recs = list(read_documents(str(path), "parquet", path.name, max_record_bytes=200_000))
    assert [r.text for r in recs] == texts
    assert max(seen) <= (1 << 20) + 100_000 + 16 * 4096, max(seen)


def test_a_sibling_column_named_like_a_nested_leaf_is_not_held_to_the_guard(tmp_path):
    """Only the leaves of the text and id fields are walked: a top-level column named 'text.big' (another field,
    never read) with pages over the limit leaves the text rows documents."""
    t = pa.table({"text": [f"Row {i}." for i in range(3)], "text.big": ["x" * 5000] * 3})
    pq.write_table(t, tmp_path / "sib.parquet", use_dictionary=False)
    recs = list(read_documents(str(tmp_path / "sib.parquet"), "parquet", "sib.parquet", max_record_bytes=1000))
    assert [r.text for r in recs] == t.column("text").to_pylist()


def test_a_text_column_of_lists_is_a_dead_letter_per_row_not_an_unreadable_file(tmp_path):
    """A dictionary-encoded list<string> text column: each row is a record dead letter "not a string" naming the
    type, not one "unreadable file: KeyError" for the file."""
    pq.write_table(pa.table({"text": [["a b"], ["c"]]}), tmp_path / "ls.parquet")
    recs = list(read_documents(str(tmp_path / "ls.parquet"), "parquet", "ls.parquet"))
    assert [(r.id, r.reason, r.excerpt) for r in recs] == [
        (f"ls.parquet:{i}", "unreadable record: 'text' is list<element: string>, not a string", "") for i in (1, 2)]


def test_a_struct_whose_child_path_clashes_with_the_text_column_is_never_decoded(tmp_path, monkeypatch):
    """`--text-field text.x` reads the flat column text.x alone: by name pyarrow would also decode a struct text's
    child x (here a 24 MB page of a file of a few KB, or a list of 2,000,000 strings); by index it is never read."""
    import elmo_pipeline.transforms.read as read
    n, seen, texts_within = 2_000_000, [], read._texts_within
    monkeypatch.setattr(read, "_texts_within", lambda column, cap: (seen.append(column.nbytes),
                                                                     texts_within(column, cap))[1])
    for child in (pa.array([{"x": f"{i:02d}" * 1_500_000} for i in range(8)]),
                  pa.StructArray.from_arrays([pa.ListArray.from_arrays(
                      pa.array([0, n] + [n] * 7, pa.int32()), pa.array(["ab"]).take(pa.array([0] * n)))], ["x"])):
        t = pa.table({"text": child, "text.x": [f"short {i}" for i in range(8)]})
        pq.write_table(t, tmp_path / "clash.parquet", use_dictionary=False, data_page_size=1 << 30,
                       compression="zstd")
        assert os.path.getsize(tmp_path / "clash.parquet") < 40_000
        recs = list(read_documents(str(tmp_path / "clash.parquet"), "parquet", "clash.parquet", "text.x",
                                   max_record_bytes=1_000_000))
        assert [r.text for r in recs] == t.column("text.x").to_pylist() and max(seen) < 1000


def _xz_declaring(data: bytes, dict_prop: int) -> bytes:
    """`data` as one .xz stream whose LZMA2 filter declares dictionary size property `dict_prop` (38: 2 GiB, 29:
    96 MiB; the data is compressed with a 64 KiB one), its block header's CRC32 fixed up."""
    import lzma
    import struct
    import zlib
    xz = bytearray(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32,
                                 filters=[{"id": lzma.FILTER_LZMA2, "preset": 0, "dict_size": 1 << 16}]))
    size = (xz[12] + 1) * 4                   # the block header, after the 12-byte stream header
    assert xz[14] == 0x21 and xz[15] == 1     # one filter, LZMA2, its one property byte
    xz[16] = dict_prop
    xz[12 + size - 4:12 + size] = struct.pack("<I", zlib.crc32(bytes(xz[12:12 + size - 4])))
    return bytes(xz)


def test_an_xz_file_needing_more_than_128_mib_to_decode_is_refused_unread(tmp_path):
    """An .xz stream declaring a 2 GiB dictionary (liblzma allocates what it declares, and decoding writes through
    it) is one "unreadable file" dead letter before anything is allocated, also as a second stream; 96 MiB and
    xz -9 (64 MiB) read, and so do concatenated streams (what follows them that is no stream ignored, as
    lzma.LZMAFile reads them)."""
    import lzma
    reason = ("unreadable file: compressed data needs more than 128 MiB of memory to decode (an .xz dictionary or "
              ".zst window) after line {}, the rest of the file is lost: LZMAError: Memory usage limit exceeded")
    good = lzma.compress(b"One.\nTwo.\n", preset=9)
    cases = {"big.txt.xz": (_xz_declaring(b"One.\n", 38), [reason.format(0)]),
             "second.txt.xz": (good + _xz_declaring(b"Three.\n", 38), ["One.", "Two.", reason.format(2)]),
             "ok.txt.xz": (_xz_declaring(b"One.\n", 29) + good + b"not a stream", ["One.", "One.", "Two."]),
             "ok.txt.lzma": (lzma.compress(b"One.\n", format=lzma.FORMAT_ALONE), ["One."])}
    for name, (data, want) in cases.items():
        (tmp_path / name).write_bytes(data)
        recs = list(read_documents(str(tmp_path / name), "lines", name))
        assert [getattr(r, "text", None) or r.reason for r in recs] == want, name


def test_a_zstd_frame_needing_more_than_128_mib_to_decode_is_refused_unread(tmp_path):
    """A .zst frame whose window is over 128 MiB (zstd --long=28) is refused by the same limit, saying so."""
    import zstandard
    params = zstandard.ZstdCompressionParameters(window_log=28, write_content_size=False)
    with open(tmp_path / "big.txt.zst", "wb") as f, zstandard.ZstdCompressor(compression_params=params).stream_writer(f) as w:
        w.write(b"One.\n")
    [rec] = read_documents(str(tmp_path / "big.txt.zst"), "lines", "big.txt.zst")
    assert rec.reason.startswith("unreadable file: compressed data needs more than 128 MiB of memory to decode "
                                 "(an .xz dictionary or .zst window) after line 0"), rec.reason
