"""Bad input end to end: every input line is a document (sentences written or dead-lettered), a blank
record or a record dead letter, with counts that add up exactly (tests/robustness_corpus.py)."""
import gzip
import json
import os

import h5py
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder
from elmo_pipeline.model.windows import embed_long
from tests import robustness_corpus as rc
from tests.conftest import shared_path
from tests.pipeline_helpers import parquet_rows, run_pipeline
from elmo_pipeline.formats.hdf5 import hdf5_key
from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.tokenization import align_tokens, moses_tokens, tokenize_document
from elmo_pipeline.transforms.read import read_documents
from elmo_pipeline.transforms.records import Blank, Document


@pytest.fixture(scope="module")
def robust_run(tmp_path_factory, tiny_model_files):
    out = str(tmp_path_factory.mktemp("robust"))
    files = rc.build(out, shared_path("data", "robustness"), pud_lines=60)
    manifest = rc.run(out, files, tiny_model_files, "--torch-threads", "1")
    return out, files, manifest


def test_every_input_line_is_accounted_for(robust_run):
    out, files, manifest = robust_run
    figures = rc.account(out, files, manifest)          # asserts the identities, line by line
    c = manifest["counts"]
    assert figures["dead_letters_by_reason"] == {"invalid UTF-8": 4, "no tokens": 3}
    assert c["blank_records"] == 77 + 7 + 1           # blns.txt, blank_lines.txt, crlf.txt
    assert c["input_records"] == c["documents"] + c["blank_records"] + c["record_dead_letters"]
    assert c["sentences"] == c["sentences_written"] + c["dead_letter_sentences"]


def test_bad_input_cases_come_out_right(robust_run, tiny_model_files):
    out, _, manifest = robust_run
    rows = parquet_rows(os.path.join(out, "result"), manifest)
    assert rows["bom.txt:1#0"]["tokens"][0] == "Hello"                        # BOM dropped
    assert rows["crlf.txt:1#0"]["tokens"][-1] == "." and "crlf.txt:4#0" in rows   # no \r, unterminated line kept
    assert rows["nul.txt:1#0"]["tokens"] == ["ab", "c", "."]                  # Moses deletes NUL ...
    assert rows["nul.txt:1#0"]["token_offsets"] == [[0, 3], [4, 5], [5, 6]]    # ... offsets still span the source
    assert rows["mb_line.txt:1#0"]["token_offsets"] == [[0, rc.MB_LINE_CHARS]]
    assert len(rows["many_unk.txt:1#0"]["tokens"]) == 1503                    # > sacremoses' 1000 protected tokens
    assert rows["controls.txt:3#0"]["tokens"] == ["\u200b", "\u200c", "\u200d"]  # zero-width chars are tokens
    dead = {}
    for d in manifest["dead_letter_files"]:
        with open(os.path.join(out, "result", d["path"]), encoding="utf-8") as f:
            dead.update({r["id"]: r for r in map(json.loads, f)})
    assert {k for k, v in dead.items() if v["reason"].startswith("invalid UTF-8")} == {
        "invalid_utf8.txt:2", "invalid_utf8.txt:4", "invalid_utf8.txt:6", "invalid_utf8.txt:7"}
    assert dead["controls.txt:1#0"]["reason"].startswith("no tokens") and dead["nul.txt:2#0"]["level"] == "sentence"
    # the 10,000-token sentence is embedded in windows of 1000 with 200 overlap, stitched
    long_id = "long_sentence.txt:1#0"
    tokens = rows[long_id]["tokens"]
    assert len(tokens) == rc.LONG_SENTENCE_TOKENS
    got = None
    for s in manifest["shards"]:
        with h5py.File(os.path.join(out, "result", s["hdf5"])) as f:
            if hdf5_key(long_id) in f:
                got = f[hdf5_key(long_id)][...]
    assert got is not None and got.shape[1] == rc.LONG_SENTENCE_TOKENS
    want = embed_long(ElmoEmbedder(*tiny_model_files), tokens, 1000, 200, 4096)
    assert np.abs(got - want).max() <= 1e-5


def test_stateful_mode_dead_letters_sentences_longer_than_the_window(tmp_path, tiny_model_files):
    inp = tmp_path / "x.txt"
    inp.write_text(" ".join(["word"] * 30) + "\nshort one\n")
    out = str(tmp_path / "o")
    _, m = run_pipeline(tiny_model_files, str(inp), out, "--state", "stateful", "--window-tokens", "20",
                        "--window-overlap", "5")
    assert m["counts"]["sentences_written"] == 1 and m["counts"]["dead_letters_by_reason"] == {"too long": 1}
    with open(os.path.join(out, m["dead_letter_files"][0]["path"])) as f:
        assert "--window-tokens" in json.loads(f.readline())["reason"]


def test_read_decodes_line_by_line(tmp_path):
    p = tmp_path / "a.txt.gz"
    p.write_bytes(gzip.compress(b"\xef\xbb\xbfone\r\n\xff bad\r\n \r\ntwo"))
    recs = list(read_documents(str(p), "text", "a"))
    assert recs[0] == Document("a:1", "one") and recs[2] == Blank("a:3") and recs[3] == Document("a:4", "two")
    assert isinstance(recs[1], DeadLetter) and recs[1].level == "record" and "invalid UTF-8" in recs[1].reason
    j = tmp_path / "b.jsonl"
    j.write_text('{"text": "ok"}\n{"text": "  "}\n{"text": "lone \\ud800 surrogate"}\n\n')
    recs = list(read_documents(str(j), "jsonl", "b"))
    assert recs[0] == Document("b:1", "ok") and recs[1] == Blank("b:2") and recs[3] == Blank("b:4")
    assert isinstance(recs[2], DeadLetter) and "lone surrogate" in recs[2].reason


def test_tokenizer_edge_cases():
    assert align_tokens("a\x00b c", ["ab", "c"]) == [(0, 3), (4, 5)]
    assert align_tokens("ab cd", ["ab", "zz", "cd"]) == [(0, 2), (2, 2), (3, 5)]
    assert tokenize_document("\x01\x02\x1b") == []
    assert moses_tokens(" ".join(["<unk>"] * 2001) + " end") == ["<unk>"] * 2001 + ["end"]


def _zstd(data):
    import zstandard
    half = len(data) // 2      # two frames, as concatenated .zst files have
    return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])


@pytest.mark.parametrize("ext,compress", [(".gz", gzip.compress), (".bz2", __import__("bz2").compress),
                                          (".xz", __import__("lzma").compress), (".zst", _zstd)])
def test_truncated_compressed_file_is_one_record_dead_letter(tmp_path, ext, compress, tiny_model_files):
    data = compress("".join(f"Line number {i} of the file.\n" for i in range(8000)).encode())
    p = tmp_path / ("t.txt" + ext)
    p.write_bytes(data[: len(data) // 2])
    recs = list(read_documents(str(p), "text", "t"))
    assert all(isinstance(r, Document) for r in recs[:-1])
    assert len(recs) > 1 or ext in (".bz2", ".zst")   # they decode whole blocks (900 kB, 128 kB): maybe none here
    last = recs[-1]
    assert isinstance(last, DeadLetter) and last.level == "record" and last.id == f"t:{len(recs)}"
    assert last.reason.startswith("unreadable file: compressed data truncated or corrupted after line")
    if ext != ".gz":
        return
    out = str(tmp_path / "o")                                   # the job finishes and the counts add up
    _, m = run_pipeline(tiny_model_files, str(p), out)
    c = m["counts"]
    assert c["input_records"] == len(recs) == c["documents"] + c["blank_records"] + c["record_dead_letters"]
    assert c["dead_letters_by_reason"] == {"unreadable file": 1}


def test_sentence_spans_equal_blingfires_own_offsets():
    """tokenization's sentence spans are blingfire.text_to_sentences_and_offsets's, on every line of the
    naughty-strings and 7-language files plus a few built-in cases (its offset mapping is our numpy)."""
    import glob
    import random

    import blingfire

    from elmo_pipeline.tokenization.tokenizers import _sentence_spans
    texts = ["Dr. Smith left. He said 'hi'! Then?", "é. ü! 日本。 x", "  lead space. x  ", "😀😀. a", "a\nb. c",
             "\u200b\u200c\u200d", "\u200b", "x\u200b. \u200c"]
    rng = random.Random(0)        # short texts of zero-width, combining, wide and multi-byte characters
    texts += ["".join(rng.choice(["\u200b", "\u200c", "a", " ", ".", "é", "日", "😀", "\n", "\u0301", "!"])
                      for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    for path in sorted(glob.glob(os.path.join(shared_path("data", "robustness"), "*.txt"))):
        texts += open(path, encoding="utf-8", errors="surrogateescape").read().split("\n")
    checked = 0
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:      # not text a document can hold (read.py dead-letters it)
            continue
        if t.strip():
            assert _sentence_spans(t) == [(int(s), int(e)) for s, e in blingfire.text_to_sentences_and_offsets(t)[1]], t
            checked += 1
    assert checked > 1000
