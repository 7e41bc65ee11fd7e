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
import re
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


def file_labels(files: list[str], root: str | None = None, full: bool = False) -> dict[str, str]:
    """file URL -> label. Default: its path relative to the deepest folder common to all files (a lone file:
    its name; redacted, so a presigned URL's signature is in no id). `root` (--id-root, a folder path or URL):
    its path relative to that folder; ValueError for a file outside it. `full`: the file's absolute path, or its
    URL for remote files (scheme kept). Labels from `root` and `full` never hold a URL's user info (credentials),
    query or fragment."""
    if root is not None:
        return {f: _label_under(f, root) for f in files}
    if full:
        return {f: public_url(f) for f in files}
    if len(files) == 1:
        return {files[0]: redact(posixpath.basename(files[0]))}
    common = posixpath.commonpath([f.split("://", 1)[-1] for f in files])
    return {f: redact(posixpath.relpath(f.split("://", 1)[-1], common)) for f in files}


def _place(url: str) -> tuple[str, str]:
    """(scheme, normalized path) of a file or folder: ("", absolute path) for local paths and file:// URLs;
    for remote URLs the bucket/host and path, without user info, query or fragment."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return "", posixpath.abspath(rest if sep else url)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    host, slash, path = rest.partition("/")
    return scheme, posixpath.normpath(host.rpartition("@")[2] + slash + path)


def public_url(url: str) -> str:
    """A file's absolute path, or its remote URL without user info, query or fragment."""
    scheme, path = _place(url)
    return f"{scheme}://{path}" if scheme else path


def _label_under(url: str, root: str) -> str:
    """The file's path relative to the folder `root`; ValueError when it is not under it."""
    (scheme, path), (root_scheme, root_path) = _place(url), _place(root)
    if scheme != root_scheme or not path.startswith(root_path.rstrip("/") + "/"):
        raise ValueError(f"--id-root {public_url(root)}: the input {public_url(url)} is not under it "
                         "(ids are the files' paths relative to --id-root)")
    return posixpath.relpath(path, root_path)


@dataclass(frozen=True)
class TooLong:
    """A line longer than the cap: its length in bytes (without its b"\\n") and its first bytes; the rest
    was read and dropped, never joined."""
    nbytes: int
    head: bytes


HEAD_BYTES = 4 * EXCERPT_CHARS       # bytes of a too-long line kept for its dead letter's excerpt


def split_lines(f, block: int = 1 << 16, max_bytes: int | None = None) -> Iterator[bytes | TooLong]:
    """Lines of a binary file object (any decompressor: only read() is needed), split on b"\\n" only,
    without it; an unterminated last line counts, a final b"\\n" adds no empty line. A line over `max_bytes`
    is a TooLong: memory stays within max_bytes + 2 blocks whatever the line's length."""
    parts: list[bytes] = []
    size = 0            # bytes of the current line so far
    head = b""          # its first HEAD_BYTES, once it is over max_bytes
    while chunk := f.read(block):
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            end = len(chunk) if i < 0 else i
            size += end - start
            if max_bytes is None or size <= max_bytes:
                parts.append(chunk[start:end])
            elif parts:                 # just went over: keep the head only
                head, parts = _head([*parts, chunk[start:end]]), []
            elif len(head) < HEAD_BYTES:
                head += chunk[start:min(end, start + HEAD_BYTES - len(head))]
            if i < 0:
                break
            yield TooLong(size, head) if max_bytes is not None and size > max_bytes else b"".join(parts)
            parts, size, head, start = [], 0, b"", i + 1
    if size:
        yield TooLong(size, head) if max_bytes is not None and size > max_bytes else b"".join(parts)


def _head(parts: list[bytes]) -> bytes:
    """The first HEAD_BYTES of the concatenation of `parts`, without joining them all."""
    out = bytearray()
    for p in parts:
        out += p[:HEAD_BYTES - len(out)]
        if len(out) >= HEAD_BYTES:
            break
    return bytes(out)


_CORRUPT = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)
try:
    import zstandard
    _CORRUPT += (zstandard.ZstdError,)
except ImportError:  # pragma: no cover - zstandard comes with the package's dependencies
    zstandard = None


class _ZstdReader:
    """read() over a .zst stream of one or more frames that raises EOFError when the data ends inside a
    frame (the reader fsspec uses returns a silently truncated text instead). Each read() decompresses at most
    STEP bytes of the file, so it returns at most STEP * 32768 bytes (zstd's largest ratio: a 4-byte RLE block
    of 128 KiB), 32 MiB, however far the data expands."""

    STEP = 1 << 10

    def __init__(self, raw, block: int = 1 << 16):
        self.raw, self.block, self.z = raw, block, zstandard.ZstdDecompressor()
        self.d, self.in_frame = self.z.decompressobj(), False
        self.pending, self.at = b"", 0      # compressed bytes read from the file, and how far they are fed

    def read(self, n: int = -1) -> bytes:
        while True:
            if self.at >= len(self.pending):
                self.pending, self.at = self.raw.read(self.block), 0
                if not self.pending:
                    if self.in_frame:
                        raise EOFError("Compressed file ended inside a zstd frame")
                    return b""
            chunk = self.pending[self.at:self.at + self.STEP]
            self.at += len(chunk)
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


@dataclass(frozen=True)
class _Corrupt:
    reason: str


def _lines_until_corrupt(f, max_bytes: int | None = None) -> Iterator[bytes | TooLong | _Corrupt]:
    """split_lines(f, max_bytes=max_bytes); a decompression error (truncated or corrupted .gz/.bz2/.xz) ends it
    with a _Corrupt (the lines of the 64 KiB block that failed are lost with the rest of the file).

    Only errors of the compressed data itself: I/O errors (network, permissions) propagate, so that the
    runner retries the file."""
    n = 0
    try:
        for raw in split_lines(f, max_bytes=max_bytes):
            n += 1
            yield raw
    except Exception as e:  # noqa: BLE001 - filtered just below
        if not (isinstance(e, _CORRUPT) or (type(e) is OSError and "Invalid data stream" in str(e))):   # bz2
            raise
        yield _Corrupt(f"unreadable file: compressed data truncated or corrupted after line {n}, the rest of the "
                       f"file is lost: {type(e).__name__}: {' '.join(str(e).split())}")


MAX_RECORD_BYTES = 8 << 20          # --max-record-bytes default
_JSON_TYPES = {type(None): "null", bool: "a boolean", float: "a number", list: "an array", dict: "an object"}
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class BadId(ValueError):
    """An --id-field value that cannot be a document id; its message is the dead letter's reason."""


def document_id(value, id_field: str) -> str:
    """A document id from an --id-field value (JSONL field or Parquet cell): a string as it is, an integer
    (not a boolean) as its decimal digits; BadId ("bad id: ...") for anything else (null, boolean, number
    with a fraction or exponent, array, object, bytes), an empty string, or a string holding a C0/C1 control
    character (U+0000-U+001F, U+007F-U+009F: NUL ends an HDF5 name, the others are invisible). The same id
    names the document's sentences in Parquet and HDF5 ("<id>#<n>"; HDF5 escapes only '%' and '/')."""
    if isinstance(value, str):
        bad = _CONTROL.search(value)
        if bad:
            raise BadId(f"bad id: {id_field!r} holds the control character U+{ord(bad.group()):04X} at "
                        f"character {bad.start()}")
        if not value:
            raise BadId(f"bad id: {id_field!r} is an empty string")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    what = _JSON_TYPES.get(type(value), type(value).__name__)
    raise BadId(f"bad id: {id_field!r} is {what} ({_short(value)}), not a string or an integer")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def printable_label(label: str) -> str:
    """A file label fit for ids and output text (strict UTF-8): a name that is not valid UTF-8 (Python holds
    its bad bytes as lone surrogates) gets each bad byte as a backslash escape, a\\xffb."""
    try:
        label.encode("utf-8")
        return label
    except UnicodeEncodeError:
        pass
    try:
        return label.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return label.encode("utf-8", "backslashreplace").decode("utf-8")


def read_documents(url: str, fmt: str, label: str, text_field: str = "text", id_field: str | None = None,
                   storage_options: dict | None = None, max_record_bytes: int = MAX_RECORD_BYTES
                   ) -> Iterator[Document | DeadLetter | Blank]:
    """Every record of one file, in file order: a Document, a Blank (whitespace-only) or a DeadLetter.

    Lines are split on b"\\n" only and decoded one by one as strict UTF-8 (a line that is not valid
    UTF-8 is a dead letter, its neighbours are unaffected); a trailing "\\r" is dropped (CRLF files),
    and so is a UTF-8 byte-order mark at the start of the file. A record over `max_record_bytes` is a dead
    letter "too long", read in blocks and never held whole. A failure that is not an I/O error (those
    propagate: the runner retries the file) ends the file with one record dead letter "unreadable file"
    for the rest of it; the records before it stand."""
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {fmt!r}")
    label = printable_label(label)
    n = 0
    try:
        for rec in _file_records(url, fmt, label, text_field, id_field, storage_options, max_record_bytes):
            n += 1
            yield rec
    except Exception as e:  # noqa: BLE001 - one file must not fail the run; I/O errors are re-raised
        if isinstance(e, OSError) and not isinstance(e, _CORRUPT):
            raise
        yield DeadLetter(f"{label}:{n + 1}", f"unreadable file: after record {n}, the rest of the file is lost: "
                         f"{type(e).__name__}: {' '.join(str(e).split())}"[:500], "", level="record")


def _file_records(url, fmt, label, text_field, id_field, storage_options, max_record_bytes):
    if fmt == "parquet":
        yield from _read_parquet(url, label, text_field, id_field, storage_options, max_record_bytes)
        return
    compression = fsspec.utils.infer_compression(url)
    zstd = compression == "zstd" and zstandard is not None
    metered = zstd or compression in _METERED     # decompressed here, over a byte count of the file on disk
    with open_file(url, "rb", storage_options, compression=None if metered else compression) as raw:
        meter = _Meter(raw)
        f = _ZstdReader(meter) if zstd else fsspec.compression.compr[compression](meter, mode="rb") \
            if compression and metered else meter
        try:
            yield from _line_records(f, meter, fmt, label, text_field, id_field, max_record_bytes)
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


def too_long(nbytes: int, max_record_bytes: int) -> str:
    """The reason of a record dead letter over --max-record-bytes."""
    return f"too long: record of {nbytes} bytes > --max-record-bytes {max_record_bytes}"


def _line_records(f, meter: _Meter, fmt: str, label: str, text_field: str, id_field: str | None,
                  max_record_bytes: int = MAX_RECORD_BYTES):
    """The records of a line format (text, lines, jsonl); each Document's nbytes is the bytes of the stored
    file read since the previous Document (so read-ahead and skipped records count with the next one)."""
    done = 0
    for n, raw in enumerate(_lines_until_corrupt(f, max_record_bytes), 1):
        default_id = f"{label}:{n}"
        if isinstance(raw, _Corrupt):     # one record dead letter for the unreadable rest of the file
            yield DeadLetter(default_id, raw.reason, "", level="record")
            break
        if isinstance(raw, TooLong):
            yield DeadLetter(default_id, too_long(raw.nbytes, max_record_bytes),
                             raw.head.decode("utf-8", "replace")[:EXCERPT_CHARS], level="record")
            continue
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
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
        else:
            yield _json_record(line, default_id, text_field, id_field, nbytes)


def _json_record(line: str, default_id: str, text_field: str, id_field: str | None,
                 nbytes: int) -> Document | Blank | DeadLetter:
    """One JSONL line's record; any failure (bad JSON, nesting too deep, a missing or non-string text, a bad
    id) is its record dead letter."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            raise TypeError(f"the line is {_JSON_TYPES.get(type(record), 'a ' + type(record).__name__)}, "
                            "not a JSON object")
        text = record[text_field]
        if not isinstance(text, str):
            raise TypeError(f"field {text_field!r} is {type(text).__name__}, not a string")
        doc_id = document_id(record[id_field], id_field) if id_field else default_id
        (text + doc_id).encode("utf-8")      # JSON "\\ud800" escapes decode to unencodable lone surrogates
    except BadId as e:
        return DeadLetter(default_id, str(e), line[:EXCERPT_CHARS], level="record")
    except UnicodeEncodeError as e:
        return DeadLetter(default_id, f"invalid UTF-8: lone surrogate in the JSON text or id ({e.reason})",
                          line[:EXCERPT_CHARS], level="record")
    except Exception as e:  # noqa: BLE001 - RecursionError (deep nesting) too: the record fails alone
        return DeadLetter(default_id, f"unreadable record: {type(e).__name__}: {e}"[:500], line[:EXCERPT_CHARS],
                          level="record")
    return Document(doc_id, text, source=default_id if id_field else "", nbytes=nbytes) if text.strip() \
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


BATCH_BYTES = 64 << 20      # Parquet rows are read in batches of about this many bytes of text (at most 4096 rows)


def parquet_columns(url: str, storage_options: dict | None = None) -> list[str]:
    """The column names of a Parquet file, from its footer (one small read)."""
    import pyarrow.parquet as pq
    with open_file(url, "rb", storage_options) as f:
        return pq.ParquetFile(f).schema_arrow.names


def _batch_rows(pf, column: int) -> int:
    """Rows per batch so that a batch holds about BATCH_BYTES of the column (by the row groups' uncompressed
    sizes in the footer), 1 to 4096."""
    md, per_row = pf.metadata, 0.0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows:
            per_row = max(per_row, rg.column(column).total_uncompressed_size / rg.num_rows)
    return int(max(1, min(4096, BATCH_BYTES // max(per_row, 1.0))))


def _read_parquet(url, label, text_field, id_field, storage_options,
                  max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[Document | DeadLetter | Blank]:
    """The rows of a Parquet file; a text over max_record_bytes (UTF-8) is a dead letter "too long" (left out
    of the batch before it becomes a Python string) and an --id-field cell follows document_id()."""
    import pyarrow.parquet as pq
    with open_file(url, "rb", storage_options) as f:
        size = f.seek(0, 2)         # row n's share of the file's bytes: size * n // rows - size * (n - 1) // rows
        f.seek(0)
        pf = pq.ParquetFile(f)
        rows, done = max(1, pf.metadata.num_rows), 0
        columns = [text_field] + ([id_field] if id_field else [])
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"no column(s) {missing} (has {names})")
        n = 0
        leaf = pf.schema_arrow.get_field_index(text_field)
        batch_rows = _batch_rows(pf, leaf) if pf.metadata.num_columns == len(names) else 4096
        for batch in pf.iter_batches(columns=columns, batch_size=batch_rows):
            texts, lengths = _texts_within(batch.column(0), max_record_bytes)
            ids = batch.column(1).to_pylist() if id_field else [None] * len(texts)
            for text, raw_id, nbytes in zip(texts, ids, lengths):
                n += 1
                upto = size * n // rows
                record = _parquet_record(text, raw_id, nbytes, f"{label}:{n}", text_field, id_field,
                                         max_record_bytes, upto - done)
                if isinstance(record, Document):
                    done = upto
                yield record


def _texts_within(column, max_record_bytes: int) -> tuple[list, list]:
    """(Python values of a text column, each value's UTF-8 bytes or None); a value over max_record_bytes
    comes out as None (never made a Python string)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return column.to_pylist(), [None] * len(column)
    lengths = pc.binary_length(column)
    over = pc.greater(lengths, max_record_bytes)
    if pc.any(over).as_py():
        column = pc.if_else(over, pa.scalar(None, column.type), column)
    return column.to_pylist(), lengths.to_pylist()


def _parquet_record(text, raw_id, nbytes: int | None, default_id: str, text_field: str, id_field: str | None,
                    max_record_bytes: int, share: int) -> Document | DeadLetter | Blank:
    """One Parquet row's record: text None when it is null or was left out for being over max_record_bytes
    (nbytes: its UTF-8 bytes, None for a column that is not text); share: its bytes of the file (progress)."""
    try:
        doc_id = document_id(raw_id, id_field) if id_field else default_id
    except BadId as e:
        return DeadLetter(default_id, str(e), text[:EXCERPT_CHARS] if isinstance(text, str) else "",
                          level="record")
    if nbytes is not None and nbytes > max_record_bytes:
        return DeadLetter(doc_id, too_long(nbytes, max_record_bytes), "", level="record")
    if text is None or not isinstance(text, str):
        return DeadLetter(doc_id, f"unreadable record: {text_field!r} is null or not a string",
                          repr(text)[:EXCERPT_CHARS], level="record")
    if not text.strip():
        return Blank(doc_id)
    return Document(doc_id, text, source=default_id if id_field else "", nbytes=share)
