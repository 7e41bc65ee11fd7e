"""Reading documents from text, JSONL and Parquet files (local paths or fsspec URLs). No Beam import.

Document ids: the id field when given, else "<file label>:<line or row number, 1-based>", where the
file label is the file's path relative to the deepest folder common to all inputs.
Compression (.gz, .bz2, .zst, .xz) is inferred from the file name.
"""
from __future__ import annotations

import gzip
import json
import lzma
import posixpath
import zlib
from dataclasses import dataclass
from typing import Iterator

import fsspec.utils

from formats.layout import EXCERPT_CHARS, DeadLetter
from fsio import open_file, redact
from transforms.records import Blank, Document

INPUT_FORMATS = ("text", "lines", "jsonl", "parquet")


def decode_line(raw: bytes, record_id: str) -> str | DeadLetter:
    """A line's bytes as text (strict UTF-8), or a record dead letter "invalid UTF-8" naming the byte offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DeadLetter(record_id, f"invalid UTF-8: {e.reason} at byte {e.start} of the line",
                          raw.decode("utf-8", "replace")[:EXCERPT_CHARS], level="record")


def file_labels(files: list[str]) -> dict[str, str]:
    """file URL -> label: its path relative to the deepest folder common to all files (redacted: a presigned
    URL's signature is in no document id)."""
    if len(files) == 1:
        return {files[0]: redact(posixpath.basename(files[0]))}
    common = posixpath.commonpath([f.split("://", 1)[-1] for f in files])
    return {f: redact(posixpath.relpath(f.split("://", 1)[-1], common)) for f in files}


def split_lines(f, block: int = 1 << 16) -> Iterator[bytes]:
    """Lines of a binary file object (any decompressor: only read() is needed), split on b"\\n" only,
    without it; an unterminated last line counts, a final b"\\n" adds no empty line."""
    parts: list[bytes] = []
    while True:
        chunk = f.read(block)
        if not chunk:
            break
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                parts.append(chunk[start:])
                break
            parts.append(chunk[start:i])
            yield b"".join(parts)
            parts, start = [], i + 1
    if any(parts):
        yield b"".join(parts)


_CORRUPT = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)
try:
    import zstandard
    _CORRUPT += (zstandard.ZstdError,)
except ImportError:  # pragma: no cover - zstandard comes with the package's dependencies
    zstandard = None


class _ZstdReader:
    """read() over a .zst stream of one or more frames that raises EOFError when the data ends inside a
    frame (the reader fsspec uses returns a silently truncated text instead)."""

    def __init__(self, raw, block: int = 1 << 16):
        self.raw, self.block, self.z = raw, block, zstandard.ZstdDecompressor()
        self.d, self.in_frame, self.done = self.z.decompressobj(), False, False

    def read(self, n: int = -1) -> bytes:
        while not self.done:
            chunk = self.raw.read(self.block)
            if not chunk:
                if self.in_frame:
                    raise EOFError("Compressed file ended inside a zstd frame")
                self.done = True
                break
            out = []
            while chunk:
                self.in_frame = True
                out.append(self.d.decompress(chunk))
                if not self.d.eof:
                    break
                chunk = self.d.unused_data            # the next frame starts here
                self.d, self.in_frame = self.z.decompressobj(), False
            if any(out):
                return b"".join(out)
        return b""


@dataclass(frozen=True)
class _Corrupt:
    reason: str


def _lines_until_corrupt(f) -> Iterator[bytes | _Corrupt]:
    """split_lines(f); a decompression error (truncated or corrupted .gz/.bz2/.xz) ends it with a _Corrupt
    (the lines of the 64 KiB block that failed are lost with the rest of the file).

    Only errors of the compressed data itself: I/O errors (network, permissions) propagate, so that the
    runner retries the file."""
    n = 0
    try:
        for raw in split_lines(f):
            n += 1
            yield raw
    except Exception as e:  # noqa: BLE001 - filtered just below
        if not (isinstance(e, _CORRUPT) or (type(e) is OSError and "Invalid data stream" in str(e))):   # bz2
            raise
        yield _Corrupt(f"unreadable file: compressed data truncated or corrupted after line {n}, the rest of the "
                       f"file is lost: {type(e).__name__}: {' '.join(str(e).split())}")


def read_documents(url: str, fmt: str, label: str, text_field: str = "text", id_field: str | None = None,
                   storage_options: dict | None = None) -> Iterator[Document | DeadLetter | Blank]:
    """Every record of one file, in file order: a Document, a Blank (whitespace-only) or a DeadLetter.

    Lines are split on b"\\n" only and decoded one by one as strict UTF-8 (a line that is not valid
    UTF-8 is a dead letter, its neighbours are unaffected); a trailing "\\r" is dropped (CRLF files),
    and so is a UTF-8 byte-order mark at the start of the file."""
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {fmt!r}")
    if fmt == "parquet":
        yield from _read_parquet(url, label, text_field, id_field, storage_options)
        return
    compression = fsspec.utils.infer_compression(url)
    zstd = compression == "zstd" and zstandard is not None
    metered = zstd or compression in _METERED     # decompressed here, over a byte count of the file on disk
    with open_file(url, "rb", storage_options, compression=None if metered else compression) as raw:
        meter = _Meter(raw)
        f = _ZstdReader(meter) if zstd else fsspec.compression.compr[compression](meter, mode="rb") \
            if compression and metered else meter
        try:
            yield from _line_records(f, meter, fmt, label, text_field, id_field)
        finally:
            if f is not meter and hasattr(f, "close"):
                f.close()


_METERED = (None, "gzip", "bz2", "lzma", "xz")


class _Meter:
    """read() over a file object, counting the bytes read: a record's share of the file as stored (progress)."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.n += len(b)
        return b

    def __getattr__(self, name):
        return getattr(self.f, name)


def _line_records(f, meter: _Meter, fmt: str, label: str, text_field: str, id_field: str | None):
    """The records of a line format (text, lines, jsonl); each Document's nbytes is the bytes of the stored
    file read since the previous Document (so read-ahead and skipped records count with the next one)."""
    done = 0
    for n, raw in enumerate(_lines_until_corrupt(f), 1):
        if isinstance(raw, _Corrupt):     # one record dead letter for the unreadable rest of the file
            yield DeadLetter(f"{label}:{n}", raw.reason, "", level="record")
            break
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        default_id = f"{label}:{n}"
        line = decode_line(raw, default_id)
        if isinstance(line, DeadLetter):
            yield line
            continue
        if not line.strip():
            yield Blank(default_id)
            continue
        nbytes, done = meter.n - done, meter.n
        if fmt in ("text", "lines"):
            yield Document(default_id, line, split_sentences=(fmt == "text"), nbytes=nbytes)
            continue
        try:
            record = json.loads(line)
            text = record[text_field]
            if not isinstance(text, str):
                raise TypeError(f"field {text_field!r} is {type(text).__name__}, not a string")
            doc_id = str(record[id_field]) if id_field else default_id
            (text + doc_id).encode("utf-8")      # JSON "\\ud800" escapes decode to unencodable lone surrogates
        except UnicodeEncodeError as e:
            yield DeadLetter(default_id, f"invalid UTF-8: lone surrogate in the JSON text or id ({e.reason})",
                             line[:EXCERPT_CHARS], level="record")
            continue
        except (ValueError, KeyError, TypeError) as e:
            yield DeadLetter(default_id, f"unreadable record: {type(e).__name__}: {e}", line[:EXCERPT_CHARS],
                             level="record")
            continue
        yield Document(doc_id, text, source=default_id if id_field else "", nbytes=nbytes) if text.strip() \
            else Blank(doc_id)


def split_duplicate_ids(doc_id: str, docs) -> Iterator[Document | DeadLetter]:
    """The documents that share one id: the document itself when it is alone; else a record dead letter
    "duplicate id" for each of them (by its source "<file>:<line>"), since ids must be unique (resume and
    HDF5 keys rely on them) and no copy is more right than another."""
    docs = sorted(docs, key=lambda d: d.source)
    if len(docs) == 1:
        yield docs[0]
        return
    where = ", ".join(d.source for d in docs[:5]) + (", ..." if len(docs) > 5 else "")
    for d in docs:
        yield DeadLetter(d.source or doc_id, f"duplicate id: {len(docs)} records have the id {doc_id!r} "
                         f"(--id-field): {where}", d.text[:EXCERPT_CHARS], level="record")


def _read_parquet(url, label, text_field, id_field, storage_options) -> Iterator[Document | DeadLetter]:
    import pyarrow.parquet as pq
    with open_file(url, "rb", storage_options) as f:
        size = f.seek(0, 2)         # row n's share of the file's bytes: size * n // rows - size * (n - 1) // rows
        f.seek(0)
        pf = pq.ParquetFile(f)
        rows, done = max(1, pf.metadata.num_rows), 0
        columns = [text_field] + ([id_field] if id_field else [])
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise ValueError(f"{url}: no column(s) {missing} (has {pf.schema_arrow.names})")
        n = 0
        for batch in pf.iter_batches(columns=columns, batch_size=4096):
            texts = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if id_field else [None] * len(texts)
            for text, doc_id in zip(texts, ids):
                n += 1
                rid = f"{label}:{n}" if doc_id is None else str(doc_id)
                if text is None or not isinstance(text, str):
                    yield DeadLetter(rid, f"unreadable record: {text_field!r} is null or not a string",
                                     repr(text)[:EXCERPT_CHARS], level="record")
                elif text.strip():
                    upto = size * n // rows
                    yield Document(rid, text, source=f"{label}:{n}" if id_field else "", nbytes=upto - done)
                    done = upto
                else:
                    yield Blank(rid)
