"""A record fails alone: hostile ids, nesting, huge lines, wrong Parquet columns and file names that are not
UTF-8 give dead letters with their reasons (or one line before anything is staged), never a crashed run."""
import gzip
import json
import os
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.formats.hdf5 import hdf5_key
from elmo_pipeline.pipeline import exits
from elmo_pipeline.pipeline.run import main
from tests.pipeline_helpers import hdf5_arrays, parquet_rows


def _run(model, inp, out, *extra) -> int:
    options, weights = model
    return main(["--input", inp, "--output", out, "--options-file", options, "--weight-file", weights,
                 "--torch-threads", "1", "--progress", "off", *extra])


def _finished(out) -> tuple[dict, dict]:
    """(manifest, {dead-letter id: letter}) of a finished output; asserts the accounting identities."""
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    dead = {}
    for d in m["dead_letter_files"]:
        with open(os.path.join(out, d["path"]), encoding="utf-8") as f:
            dead.update({r["id"]: r for r in map(json.loads, f)})
    c = m["counts"]
    assert c["input_records"] == c["documents"] + c["blank_records"] + c["record_dead_letters"]
    assert c["sentences"] == c["sentences_written"] + c["dead_letter_sentences"]
    assert c["dead_letters"] == c["record_dead_letters"] + c["dead_letter_sentences"] == len(dead)
    return m, dead


def test_bad_ids_are_dead_letters_and_hdf5_keys_equal_parquet_ids(tmp_path, tiny_model_files):
    lines = [{"id": "a\u0000b", "text": "First sentence. Second sentence."},    # NUL: HDF5 would cut the name
             {"id": "x\u0085y", "text": "A C1 control."},
             {"id": None, "text": "A null id."}, {"id": True, "text": "A boolean id."},
             {"id": 1.5, "text": "A number id."}, {"id": ["l"], "text": "An array id."}, {"id": "", "text": "Empty."},
             {"id": 12345, "text": "An integer id."}, {"id": "12345", "text": "The same id as a string."},
             {"id": "ok/..", "text": "A good one. Two sentences."}]
    inp = tmp_path / "ids.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(inp), out, "--input-format", "jsonl", "--id-field", "id") == exits.OK
    m, dead = _finished(out)
    bad = {k: v["reason"] for k, v in dead.items() if v["reason"].startswith("bad id")}
    assert sorted(bad) == [f"ids.jsonl:{n}" for n in range(1, 8)]
    assert "U+0000 at character 1" in bad["ids.jsonl:1"] and "U+0085" in bad["ids.jsonl:2"]
    assert "is null" in bad["ids.jsonl:3"] and "a boolean" in bad["ids.jsonl:4"] and "empty" in bad["ids.jsonl:7"]
    assert {dead[k]["reason"].split(":")[0] for k in ("ids.jsonl:8", "ids.jsonl:9")} == {"duplicate id"}
    rows = parquet_rows(out, m)
    assert sorted(rows) == ["ok/..#0", "ok/..#1"]
    assert sorted(hdf5_arrays(out, m)) == sorted(hdf5_key(i) for i in rows)
    assert m["counts"]["dead_letters_by_reason"] == {"bad id": 7, "duplicate id": 2}


def test_deep_json_nesting_is_one_dead_letter_between_good_lines(tmp_path, tiny_model_files):
    inp = tmp_path / "deep.jsonl"
    inp.write_text('{"text": "Good one."}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"text": "Good two."}\n')
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(inp), out, "--input-format", "jsonl") == exits.OK
    m, dead = _finished(out)
    assert dead["deep.jsonl:2"]["reason"].startswith("unreadable record: RecursionError")
    assert sorted(parquet_rows(out, m)) == ["deep.jsonl:1#0", "deep.jsonl:3#0"]


@pytest.mark.parametrize("name", ["long.txt", "long.txt.gz"])
def test_a_line_over_max_record_bytes_is_a_dead_letter(tmp_path, tiny_model_files, name):
    data = b"Before it.\n" + b"y" * 300_000 + b"\nAfter it.\n"
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(tmp_path / name), out, "--max-record-bytes", "100000") == exits.OK
    m, dead = _finished(out)
    assert dead[f"{name}:2"]["reason"] == "too long: record of 300000 bytes > --max-record-bytes 100000"
    assert dead[f"{name}:2"]["excerpt"] == "y" * 200 and dead[f"{name}:2"]["level"] == "record"
    assert sorted(parquet_rows(out, m)) == [f"{name}:1#0", f"{name}:3#0"]


def test_a_document_over_max_document_tokens_is_its_sentence_0(tmp_path, tiny_model_files):
    inp = tmp_path / "d.txt"
    inp.write_text("One two three. Four five six. Seven eight nine.\nShort one.\n")
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(inp), out, "--max-document-tokens", "10") == exits.OK
    m, dead = _finished(out)
    assert dead["d.txt:1#0"]["reason"] == "too long: document of 12 tokens > --max-document-tokens 10"
    assert sorted(parquet_rows(out, m)) == ["d.txt:2#0"]


def test_split_lines_holds_no_more_than_the_cap_of_a_huge_line():
    from elmo_pipeline.transforms.lines import HEAD_BYTES, TooLong, split_lines

    class Endless:          # 20 MiB of one line, then "\nend", made up as it is read
        def __init__(self):
            self.pieces = iter([b"z" * (1 << 16)] * 320 + [b"\nend"])

        def read(self, n):
            return next(self.pieces, b"")

    tracemalloc.start()
    try:
        lines = list(split_lines(Endless(), max_bytes=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines == [TooLong(20 << 20, b"z" * HEAD_BYTES), b"end"]
    assert peak < 4 << 20, peak         # the cap (1 MiB) and a block or two, never the 20 MiB line


def test_a_zstd_bomb_is_decoded_a_bounded_piece_at_a_time():
    zstandard = pytest.importorskip("zstandard")
    import io

    from elmo_pipeline.transforms.lines import _ZstdReader
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))
    r = _ZstdReader(io.BytesIO(bomb))
    sizes = []
    while piece := r.read(1 << 16):
        sizes.append(len(piece))
    assert sum(sizes) == 64 << 20 and max(sizes) <= _ZstdReader.STEP * 32768


def test_parquet_column_missing_fails_before_staging_and_the_fix_runs(tmp_path, tiny_model_files, capsys):
    pq.write_table(pa.table({"body": ["Hello there.", "Second one."], "k": ["a", "b"]}), tmp_path / "p.parquet")
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(tmp_path / "p.parquet"), out, "--input-format", "parquet") == exits.USAGE
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: --text-field 'text': the Parquet input") and "(its columns: body, k)" in line
    assert not os.path.exists(out)                          # nothing staged: the fixed command needs no --overwrite
    assert _run(tiny_model_files, str(tmp_path / "p.parquet"), out, "--input-format", "parquet",
                "--text-field", "body", "--id-field", "id") == exits.USAGE
    assert not os.path.exists(out)
    assert _run(tiny_model_files, str(tmp_path / "p.parquet"), out, "--input-format", "parquet",
                "--text-field", "body", "--id-field", "k") == exits.OK
    assert sorted(parquet_rows(out, _finished(out)[0])) == ["a#0", "b#0"]


def test_parquet_rows_follow_the_id_rule_and_the_cap_and_a_corrupt_file_fails_alone(tmp_path, tiny_model_files):
    pq.write_table(pa.table({"text": ["Fine.", "Null id.", "Nul id.", "w" * 5000, "Int id."],
                             "id": ["f", None, "n\u0000", "big", "7"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 not a parquet file at all")
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(tmp_path / "*.parquet"), out, "--input-format", "parquet", "--id-field", "id",
                "--max-record-bytes", "4000") == exits.OK
    m, dead = _finished(out)
    assert dead["a.parquet:2"]["reason"].startswith("bad id: 'id' is null")
    assert dead["a.parquet:3"]["reason"].startswith("bad id: 'id' holds the control character U+0000")
    assert dead["big"]["reason"] == "too long: record of 5000 bytes > --max-record-bytes 4000"
    assert dead["b.parquet:1"]["reason"].startswith("unreadable file: after record 0, the rest of the file is lost")
    assert sorted(parquet_rows(out, m)) == ["7#0", "f#0"]
    assert m["counts"]["input_records"] == 6


def test_an_input_named_with_invalid_utf8_is_read_with_its_name_escaped(tmp_path, tiny_model_files):
    folder = os.fsencode(str(tmp_path / "in"))
    os.makedirs(folder)
    with open(os.path.join(folder, b"a\xffb.txt"), "wb") as f:
        f.write(b"Hello world.\n")
    with open(os.path.join(folder, b"ok.txt"), "wb") as f:
        f.write(b"Fine too.\n")
    out = str(tmp_path / "out")
    assert _run(tiny_model_files, str(tmp_path / "in" / "*.txt"), out) == exits.OK
    m, dead = _finished(out)
    assert sorted(parquet_rows(out, m)) == ["a\\xffb.txt:1#0", "ok.txt:1#0"] and not dead
    assert sorted(hdf5_arrays(out, m)) == ["a\\xffb.txt:1#0", "ok.txt:1#0"]


@pytest.mark.parametrize("flag", ["--max-record-bytes", "--max-document-tokens"])
def test_limits_must_be_positive(tmp_path, tiny_model_files, flag, capsys):
    (tmp_path / "x.txt").write_text("Hi.\n")
    assert _run(tiny_model_files, str(tmp_path / "x.txt"), str(tmp_path / "o"), flag, "0") == exits.USAGE
    assert capsys.readouterr().err.startswith(f"error: {flag} must be >= 1, got 0")
