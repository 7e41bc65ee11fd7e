"""Parquet page headers read from a file without decoding any page: the sizes a reader would decompress.

Page headers are Thrift compact-protocol structs (parquet.thrift PageHeader) that precede each page of a column
chunk; pyarrow does not expose them, so this reads them: a few small reads per page, never a page's data."""
from __future__ import annotations

from typing import Iterator, NamedTuple


class Page(NamedTuple):
    kind: int                   # PageType: 0 data, 1 index, 2 dictionary, 3 data v2
    uncompressed: int           # uncompressed_page_size: what decoding the page decompresses
    compressed: int             # compressed_page_size: the bytes after the header
    header: int                 # the header's own bytes
    count: int                  # num_values of a data page (v1 or v2: what decoding reads) or a dictionary page; 0


class _Compact:
    """Thrift compact protocol, the part a PageHeader needs: read from file f at byte `pos`, 4 KiB at a time;
    a long binary (statistics) is skipped over, never read."""

    def __init__(self, f, pos: int):
        self.f, self.pos, self.at, self.buf = f, pos, pos, b""

    def byte(self) -> int:
        i = self.pos - self.at
        if not 0 <= i < len(self.buf):
            self.f.seek(self.pos)
            self.at, self.buf, i = self.pos, self.f.read(4096), 0
            if not self.buf:
                raise EOFError(f"Parquet page header past the end of the file at byte {self.pos}")
        self.pos += 1
        return self.buf[i]

    def varint(self) -> int:
        n = shift = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if b < 0x80:
                return n
            shift += 7
            if shift > 70:
                raise ValueError("bad Parquet page header: varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, t: int, depth: int = 0) -> None:
        """Pass over one value of compact type t."""
        if depth > 32:
            raise ValueError("bad Parquet page header: nested too deep")
        if t in (1, 2):                         # bool in a field header: no bytes
            return
        if t == 3:
            self.byte()
        elif t in (4, 5, 6):
            self.varint()
        elif t == 7:
            self.pos += 8
        elif t == 8:
            n = self.varint()
            self.pos += n
        elif t in (9, 10):                      # list, set: size and element type in one byte
            head = self.byte()
            size, et = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.byte() if et in (1, 2) else self.skip(et, depth + 1)
        elif t == 11:                           # map
            size = self.varint()
            if size:
                kv = self.byte()
                for _ in range(size):
                    self.skip(kv >> 4, depth + 1)
                    self.skip(kv & 0x0F, depth + 1)
        elif t == 12:
            self.struct(depth + 1)
        else:
            raise ValueError(f"bad Parquet page header: compact type {t}")

    def struct(self, depth: int = 0, wanted: tuple = (), inner: dict | None = None) -> dict[int, int]:
        """Read a struct to its stop field; the values of the i32 fields in `wanted` by field id, and of the
        struct fields in `inner` ({field id: its wanted i32 fields}) the i32 fields it names, as {field id: value}."""
        found, last = {}, 0
        while True:
            head = self.byte()
            t = head & 0x0F
            if t == 0:
                return found
            last = last + (head >> 4) if head >> 4 else self.zigzag()
            if last in wanted and t == 5:
                found[last] = self.zigzag()
            elif inner and last in inner and t == 12:
                found[last] = self.struct(depth + 1, inner[last])
            else:
                self.skip(t, depth)


def column_pages(f, start: int, length: int) -> Iterator[Page]:
    """The pages of the column chunk stored at bytes [start, start + length) of file f, headers only."""
    pos, end = start, start + length
    while pos < end:
        r = _Compact(f, pos)
        # PageHeader: 1 type, 2 uncompressed_page_size, 3 compressed_page_size; 5 DataPageHeader, 7
        # DictionaryPageHeader, 8 DataPageHeaderV2: each with 1 num_values (a v2 page's num_rows is not checked by
        # readers, its num_values is)
        fields = r.struct(wanted=(1, 2, 3), inner={5: (1,), 7: (1,), 8: (1,)})
        if not {1, 2, 3} <= fields.keys() or fields[2] < 0 or fields[3] < 0:
            raise ValueError(f"bad Parquet page header at byte {pos}: {fields}")
        count = max(fields.get(5, {}).get(1, 0), fields.get(7, {}).get(1, 0), fields.get(8, {}).get(1, 0))
        yield Page(fields[1], fields[2], fields[3], r.pos - pos, count)
        pos = r.pos + fields[3]


def chunk_span(column) -> tuple[int, int]:
    """(first byte, length) of a column chunk from its footer metadata (pyarrow ColumnChunkMetaData): it starts
    at its dictionary page when it has one, else at its first data page; (0, 0) for a chunk of no values (pyarrow
    writes an empty row group's offsets as 0 and 4: no page to walk)."""
    if column.num_values == 0:
        return 0, 0
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return start, column.total_compressed_size
