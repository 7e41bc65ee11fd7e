"""Property-based fuzzing (Hypothesis) of the readers, the id rule and the tokenizer: whatever the bytes,
every line is accounted for exactly once and nothing raises out of them."""
import gzip
import io
import json
import os
import re
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.tokenization import TOKENIZERS
from elmo_pipeline.tokenization.process import tokenize_or_reason
from elmo_pipeline.transforms.records import Blank, Document

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# bytes rich in what readers trip on: newlines, CR, NUL, BOM and UTF-8 lead/continuation bytes, JSON syntax
LINE_BYTES = st.lists(st.one_of(st.binary(max_size=40), st.sampled_from(
    [b"\n", b"\r\n", b"\x00", b"\xef\xbb\xbf", b"\xc3", b"\xa9", b"\xff", b"{", b"}", b"[", b'"text"', b":", b" ",
     b'{"text": "A b."}', b'{"text": "x", "id": 1}', b"\\ud800"])), max_size=30).map(b"".join)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=3), max_leaves=5)


def _lines(data: bytes) -> list[bytes]:
    """The lines a reader must see: split on b"\\n" only, a final b"\\n" adds none, an empty file has none."""
    lines = data.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


def _read(data: bytes, name: str, fmt: str, **kw) -> list:
    from elmo_pipeline.transforms.read import read_documents
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return list(read_documents(path, fmt, "f", **kw))


@FUZZ
@given(data=LINE_BYTES, block=st.integers(1, 70), cap=st.integers(1, 60) | st.none())
def test_split_lines_gives_every_line_once_or_its_length(data, block, cap):
    from elmo_pipeline.transforms.lines import HEAD_BYTES, TooLong, split_lines
    got = list(split_lines(io.BytesIO(data), block=block, max_bytes=cap))
    want = [TooLong(len(x), x[:HEAD_BYTES]) if cap is not None and len(x) > cap else x for x in _lines(data)]
    assert got == want


@FUZZ
@given(data=LINE_BYTES, fmt=st.sampled_from(["text", "lines", "jsonl"]), cap=st.integers(1, 60),
       compress=st.booleans(), id_field=st.sampled_from([None, "id"]))
def test_every_line_is_one_document_blank_or_dead_letter(data, fmt, cap, compress, id_field):
    recs = _read(gzip.compress(data) if compress else data, "x.gz" if compress else "x", fmt,
                 id_field=id_field, max_record_bytes=cap)
    lines = _lines(data)
    if lines and (lines[0].startswith((b"\xff\xfe", b"\xfe\xff", b"\0\0\xfe\xff")) or
                  (len(lines) == 1 and b"\r" in lines[0][:-1])):      # not UTF-8 with LF or CRLF ends: refused whole
        assert len(recs) == 1 and recs[0].id == "f:1" and recs[0].reason.startswith("unreadable file: ")
        return
    assert len(recs) == len(lines)
    assert all(isinstance(r, (Document, Blank, DeadLetter)) for r in recs)
    for n, r in enumerate(recs, 1):
        if isinstance(r, DeadLetter):
            assert r.level == "record" and r.id == f"f:{n}" and r.reason.split(":")[0] in {
                "invalid UTF-8", "unreadable record", "too long", "bad id"}
        elif id_field is None or fmt != "jsonl":     # the id field is JSONL's
            assert (r.doc_id if isinstance(r, Document) else r.id) == f"f:{n}"
        if isinstance(r, Document):
            r.text.encode("utf-8")          # writable as Parquet text
            assert len(r.text.encode("utf-8")) <= cap
            if id_field and fmt == "jsonl":
                assert r.doc_id and not CONTROL.search(r.doc_id) and r.source == f"f:{n}"


def _compress(data: bytes, codec: str) -> bytes:
    import bz2
    import lzma

    import zstandard
    return {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
            "zst": zstandard.ZstdCompressor().compress}[codec](data)


@FUZZ
@given(data=LINE_BYTES, codec=st.sampled_from(["gz", "bz2", "xz", "zst"]), cut=st.integers(0, 200),
       flips=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 255)), max_size=3), cap=st.integers(1, 60))
def test_damaged_compressed_data_ends_in_one_dead_letter_never_an_exception(data, codec, cut, flips, cap):
    packed = bytearray(_compress(data, codec))
    for at, x in flips:
        packed[at % len(packed)] ^= x
    packed = bytes(packed[:max(0, len(packed) - cut)])
    recs = _read(packed, f"x.{codec}", "text", max_record_bytes=cap)
    assert all(isinstance(r, (Document, Blank, DeadLetter)) for r in recs)
    assert [getattr(r, "doc_id", None) or r.id for r in recs] == [f"f:{n}" for n in range(1, len(recs) + 1)]
    assert all(len(r.text.encode("utf-8")) <= cap for r in recs if isinstance(r, Document))
    unreadable = [r for r in recs if isinstance(r, DeadLetter) and r.reason.startswith("unreadable file")]
    assert len(unreadable) <= 1 and (not unreadable or unreadable[0] is recs[-1])
    if not unreadable and not flips:
        assert len(recs) == len(_lines(data)) or not packed     # cut to nothing: an empty file, no records


@FUZZ
@given(value=JSON_VALUES)
def test_the_id_rule_takes_strings_and_integers_only(value):
    from elmo_pipeline.transforms.ids import BadId, document_id
    try:
        got = document_id(value, "id")
    except BadId as e:
        assert str(e).startswith("bad id: 'id' ")
        assert not (isinstance(value, str) and value and not CONTROL.search(value))
        assert not (isinstance(value, int) and not isinstance(value, bool))
        return
    assert got and not CONTROL.search(got)
    assert got == (value if isinstance(value, str) else str(value))
    assert isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


@FUZZ
@given(value=JSON_VALUES, text=st.text(max_size=30))
def test_jsonl_ids_follow_the_rule_through_the_reader(value, text):
    from elmo_pipeline.transforms.ids import BadId, document_id
    line = json.dumps({"id": value, "text": text}).encode() + b"\n"
    (rec,) = _read(line, "x.jsonl", "jsonl", id_field="id")
    try:
        want = document_id(value, "id")
    except BadId:
        assert isinstance(rec, DeadLetter) and rec.reason.startswith("bad id")
        return
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text + want):
        assert isinstance(rec, DeadLetter) and rec.reason.startswith("invalid UTF-8")
    elif text.strip():
        assert rec == Document(want, text, source="f:1")
    else:
        assert rec == Blank(want)


@FUZZ
@given(text=st.text(max_size=80), mode=st.sampled_from(TOKENIZERS), split=st.booleans())
def test_the_tokenizer_never_raises_and_offsets_stay_in_the_text(text, mode, split):
    from elmo_pipeline.transforms.sentences import document_reason
    out = tokenize_or_reason(text, mode, split)
    assert isinstance(out, (list, str))
    if isinstance(out, str):        # the tokenizer failed: that document's dead letter, sentence #0
        assert document_reason(out, 10).startswith("tokenizer failed")
        return
    for s in out:
        assert s.tokens and len(s.tokens) == len(s.offsets)
        assert all(0 <= a <= b <= len(text) for a, b in s.offsets)
        assert list(s.offsets) == sorted(s.offsets)
    reason = document_reason(out, 10)
    assert (reason is None) == (0 < sum(len(s.tokens) for s in out) <= 10)
