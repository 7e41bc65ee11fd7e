"""Lines of a stored file, compressed or not (.gz, .bz2, .zst, .xz, inferred from the name): read in blocks,
split on b"\\n", a line over the record cap kept as its length and first bytes. No Beam import."""
from __future__ import annotations

import gzip
import lzma
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import fsspec.utils

from elmo_pipeline.formats.layout import EXCERPT_CHARS
from elmo_pipeline.fsio import open_file, redact


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


CORRUPT = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)
try:
    import zstandard
    CORRUPT += (zstandard.ZstdError,)
except ImportError:  # pragma: no cover - zstandard comes with the package's dependencies
    zstandard = None


DECODE_MEMORY = 128 << 20     # the most a decompressor may allocate: an .xz dictionary, a .zst window


class _XzReader:
    """read() over .xz/.lzma data of one or more streams, as lzma.LZMAFile reads it (data after the last stream
    that is no stream is ignored), but decoded within liblzma's memory limit DECODE_MEMORY: a stream declaring a
    larger dictionary raises LZMAError before any of it is allocated (xz -9 needs 65 MiB). Each read(n) returns
    at most n bytes."""

    def __init__(self, raw, block: int = 1 << 16):
        self.raw, self.block, self.d, self.done = raw, block, self._decompressor(), False

    @staticmethod
    def _decompressor():
        return lzma.LZMADecompressor(lzma.FORMAT_AUTO, memlimit=DECODE_MEMORY)

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            return b"".join(iter(lambda: self.read(1 << 16), b""))
        while n and not self.done:
            if self.d.eof:                          # the next stream, if any
                data = self.d.unused_data or self.raw.read(self.block)
                if not data:
                    self.done = True
                    break
                self.d = self._decompressor()
                try:
                    out = self.d.decompress(data, n)
                except lzma.LZMAError as e:
                    if "Memory usage limit" in str(e):     # a stream after the first is held to the limit too
                        raise
                    self.done = True
                    break
            else:
                data = self.raw.read(self.block) if self.d.needs_input else b""
                if self.d.needs_input and not data:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                out = self.d.decompress(data, n)
            if out:
                return out
        return b""


class _ZstdReader:
    """read() over a .zst stream of one or more frames that raises EOFError when the data ends inside a
    frame (the reader fsspec uses returns a silently truncated text instead). Each read() decompresses at most
    STEP bytes of the file, so it returns at most STEP * 32768 bytes (zstd's largest ratio: a 4-byte RLE block
    of 128 KiB), 32 MiB, however far the data expands. A frame whose window is over DECODE_MEMORY raises
    ZstdError (zstd --ultra -22 needs 128 MiB)."""

    STEP = 1 << 10

    def __init__(self, raw, block: int = 1 << 16):
        self.raw, self.block, self.z = raw, block, zstandard.ZstdDecompressor(max_window_size=DECODE_MEMORY)
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
class Corrupt:
    reason: str


def lines_until_corrupt(f, max_bytes: int | None = None) -> Iterator[bytes | TooLong | Corrupt]:
    """split_lines(f, max_bytes=max_bytes); a decompression error (truncated or corrupted .gz/.bz2/.xz, or data
    that needs more than DECODE_MEMORY to decode) ends it with a Corrupt (the lines of the 64 KiB block that
    failed are lost with the rest of the file).

    Only errors of the compressed data itself: I/O errors (network, permissions) propagate, so that the
    runner retries the file."""
    n = 0
    try:
        for raw in split_lines(f, max_bytes=max_bytes):
            n += 1
            yield raw
    except Exception as e:  # noqa: BLE001 - filtered just below
        if not (isinstance(e, CORRUPT) or (type(e) is OSError and "Invalid data stream" in str(e))):   # bz2
            raise
        what = f"compressed data needs more than {DECODE_MEMORY >> 20} MiB of memory to decode (an .xz " \
            "dictionary or .zst window)" if _OVER_MEMORY.search(str(e)) else "compressed data truncated or corrupted"
        yield Corrupt(f"unreadable file: {what} after line {n}, the rest of the file is lost: {type(e).__name__}: "
                      f"{redact(' '.join(str(e).split()))}")


_OVER_MEMORY = re.compile(r"Memory usage limit|requires too much memory")    # liblzma's and zstd's words


OTHER_ENCODINGS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"),
                   (b"\xfe\xff", "UTF-16BE"))      # byte-order marks, the longer first


def not_utf8_lines(first: bytes, only: bool) -> str | None:
    """Why a file whose first line (split on b"\\n", as stored; its first bytes will do) is `first` is not UTF-8
    text with LF or CRLF line ends, or None: a UTF-16 or UTF-32 byte-order mark, or, in a file of one line
    (`only`), a CR before its end (CR line ends: the whole file would read as one line)."""
    for bom, name in OTHER_ENCODINGS:
        if first.startswith(bom):
            return (f"{name} text (byte-order mark {bom.hex(' ').upper()}): only UTF-8 is read; convert it, e.g. "
                    f"`iconv -f {name} -t UTF-8`")
    if only and b"\r" in first[:-1]:
        return "CR (\\r) line ends: lines must end in LF or CRLF; convert it, e.g. `tr '\\r' '\\n'`"
    return None


def utf8_lines(lines: Iterator[bytes | TooLong | Corrupt]) -> Iterator[bytes | TooLong | Corrupt]:
    """The items of `lines` (lines_until_corrupt's), or a Corrupt "unreadable file" alone for a file that is
    not UTF-8 text with LF or CRLF line ends (not_utf8_lines): it is refused whole, never read as garbage."""
    first = next(lines, None)
    if first is None or isinstance(first, Corrupt):
        if first is not None:
            yield first
        return
    second = next(lines, None)
    why = not_utf8_lines(first.head if isinstance(first, TooLong) else first, only=second is None)
    if why:
        yield Corrupt(f"unreadable file: {why}")
        return
    yield first
    if second is not None:
        yield second
        yield from lines


METERED = (None, "gzip", "bz2", "lzma", "xz")


class Meter:
    """read() over a file object, counting the bytes read: a record's share of the file as stored (progress)."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.n += len(b)
        return b

    def __getattr__(self, name):
        return getattr(self.f, name)


@contextmanager
def open_decompressed(url: str, storage_options: dict | None = None):
    """(a read()-able of the file's decompressed bytes, the Meter of its bytes as stored), for one `with`."""
    compression = fsspec.utils.infer_compression(url)
    zstd = compression == "zstd" and zstandard is not None
    metered = zstd or compression in METERED     # decompressed here, over a byte count of the file on disk
    with open_file(url, "rb", storage_options, compression=None if metered else compression) as raw:
        meter = Meter(raw)
        f = _ZstdReader(meter) if zstd else _XzReader(meter) if compression in ("lzma", "xz") else \
            fsspec.compression.compr[compression](meter, mode="rb") if compression and metered else meter
        try:
            yield f, meter
        finally:
            if f is not meter and hasattr(f, "close"):
                f.close()
