"""Parquet page headers read from a file without decoding any page: the sizes a reader would decompress.

Page headers are Thrift compact-protocol structs (parquet.thrift PageHeader) that precede each page of a column
chunk; pyarrow does not expose them, so this reads them: a few small reads per page, never a page's data."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, NamedTuple


class Page(NamedTuple):
    kind: int                   # PageType: 0 data, 1 index, 2 dictionary, 3 data v2
    uncompressed: int           # uncompressed_page_size: what decoding the page decompresses
    compressed: int             # compressed_page_size: the bytes after the header
    header: int                 # the header's own bytes
    count: int                  # num_values of a data page (v1 or v2: what decoding reads) or a dictionary page; 0


class _Compact:
    """Thrift compact protocol, the part a PageHeader needs: read from file f at byte `pos`, 4 KiB at a time, never
    past `end` (its column chunk's); a long binary (statistics) is skipped over, never read, and a container holds
    no more elements than the bytes left (a crafted count never spins)."""

    def __init__(self, f, pos: int, end: int):
        self.f, self.pos, self.at, self.buf, self.end = f, pos, pos, b"", end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise ValueError(f"bad Parquet page header: past its column chunk's end at byte {self.end}")
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
            self.over(8)
        elif t == 8:
            self.over(self.varint())
        elif t in (9, 10):                      # list, set: size and element type in one byte
            head = self.byte()
            size, et = head >> 4, head & 0x0F
            for _ in range(self.elements(self.varint() if size == 15 else size)):
                self.element(et, depth)
        elif t == 11:                           # map
            size = self.elements(self.varint())
            if size:
                kv = self.byte()
                for _ in range(size):
                    self.element(kv >> 4, depth)
                    self.element(kv & 0x0F, depth)
        elif t == 12:
            self.struct(depth + 1)
        else:
            raise ValueError(f"bad Parquet page header: compact type {t}")

    def over(self, n: int) -> None:
        """Pass over n bytes (a double, a binary) without reading them: within the chunk, or ValueError."""
        if self.pos + n > self.end:
            raise ValueError(f"bad Parquet page header: {n} bytes past its column chunk's end")
        self.pos += n

    def elements(self, n: int) -> int:
        """A container's element count n, when the chunk's bytes left can hold it (each element takes one at least)."""
        if n > self.end - self.pos:
            raise ValueError(f"bad Parquet page header: {n} elements in {self.end - self.pos} bytes")
        return n

    def element(self, t: int, depth: int) -> None:
        """Pass over one element of compact type t in a list, set or map (a bool there takes a byte)."""
        self.byte() if t in (1, 2) else self.skip(t, depth + 1)

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


def _fields(r: _Compact) -> Iterator[tuple[int, int]]:
    """(field id, compact type) of each field of the struct at r, the caller reading or skipping its value."""
    last = 0
    while True:
        head = r.byte()
        if head & 0x0F == 0:
            return
        last = last + (head >> 4) if head >> 4 else r.zigzag()
        yield last, head & 0x0F


def _list(r: _Compact) -> tuple[int, int]:
    """(element count, element type) of the list header at r."""
    head = r.byte()
    return r.elements(r.varint() if head >> 4 == 15 else head >> 4), head & 0x0F


def _struct_list(r: _Compact, t: int) -> Iterator[int]:
    """Each index of the list of structs at r (its element read by the caller), or none when it is not one."""
    n, et = _list(r) if t == 9 else (0, 12)
    if et != 12:
        for _ in range(n):
            r.element(et, 0)
        return
    yield from range(n)


def _chunk_facts(r: _Compact) -> Iterator[tuple[int, dict]]:
    """(column index, facts) of each column chunk in the footer (FileMetaData) at r, and (-1, {"encrypted": True})
    for a file whose footer names an encryption algorithm (8): a chunk's crypto metadata (ColumnChunk 8, 9:
    "encrypted"), and from meta_data (3) -> size_statistics (16) its unencoded byte count (1: "bytes") and level
    histograms' lengths (2, 3: "rep", "def")."""
    for fid, t in _fields(r):
        if fid == 8:
            yield -1, {"encrypted": True}
        if fid != 4 or t != 9:
            r.skip(t)
            continue
        for _ in _struct_list(r, t):
            for gid, gt in _fields(r):
                if gid != 1 or gt != 9:
                    r.skip(gt)
                    continue
                for c in _struct_list(r, gt):
                    facts = {"encrypted": False, "bytes": False, "rep": 0, "def": 0}
                    for cid, ct in _fields(r):
                        facts["encrypted"] |= cid in (8, 9)
                        if cid != 3 or ct != 12:
                            r.skip(ct)
                            continue
                        for mid, mt in _fields(r):
                            if mid != 16 or mt != 12:
                                r.skip(mt)
                                continue
                            for sid, st in _fields(r):
                                facts["bytes"] |= sid == 1
                                if sid in (2, 3) and st == 9:
                                    n, et = _list(r)
                                    facts["rep" if sid == 2 else "def"] = n
                                    for _ in range(n):
                                        r.element(et, 0)
                                else:
                                    r.skip(st)
                    yield c, facts


def open_checked(f, **options):
    """pyarrow's ParquetFile of the untrusted file f, its footer checked first for what makes pyarrow (25) abort the
    process as it reads a column chunk's metadata (a C++ exception it does not catch: std::terminate): level
    histograms of another length than their column's levels, an unencoded byte count on a column of no byte
    arrays, encrypted columns or footers (never read: no keys). ValueError instead."""
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(f, **options)
    f.seek(0, 2)
    size = f.tell()
    f.seek(size - 8)
    tail = f.read(8)
    footer = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or not 0 < footer <= size - 12:
        raise ValueError("not a Parquet footer (an encrypted one is not read)")
    columns = [pf.schema.column(i) for i in range(pf.metadata.num_columns)]
    for c, facts in _chunk_facts(_Compact(f, size - 8 - footer, size - 8)):
        if facts["encrypted"]:
            raise ValueError("encrypted Parquet columns are not read (no keys)")
        col = columns[c] if c < len(columns) else None
        if col is None or facts["rep"] not in (0, col.max_repetition_level + 1) or \
                facts["def"] not in (0, col.max_definition_level + 1):
            raise ValueError(f"a column chunk's level histograms ({facts['rep']}, {facts['def']} values) do not fit "
                             "its column")
        if facts["bytes"] and col.physical_type != "BYTE_ARRAY":
            raise ValueError(f"a column chunk of {col.physical_type} values counts byte-array bytes")
    return pf

def column_pages(f, start: int, length: int) -> Iterator[Page]:
    """The pages of the column chunk stored at bytes [start, start + length) of file f, headers only."""
    pos, end = start, start + length
    while pos < end:
        r = _Compact(f, pos, end)
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


VALUE_SLACK = 8         # bytes a value's page may hold beyond its own: levels, dictionary codes (RLE at worst)
PAGE_SLACK = 1024       # a page's own: level stream lengths, a bit width
TEXT_GROWTH = 3         # a token's bytes at most this many times its text's (Moses: "@-@" for "-")
_WIDTHS = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


class PagesExceed(ValueError):
    """A column's pages, by their own headers, hold or decompress to more than the counts they were written for."""


def check_page_sizes(pf, f, columns, sentences: int, tokens: int, layer_dims: Mapping[str, int],
                     max_record_bytes: int | None) -> None:
    """PagesExceed unless the pages of the leaves read for `columns` (top-level names; None: all) of a shard
    (pyarrow ParquetFile `pf` of file f, of `sentences` rows and `tokens` tokens as its manifest says) decompress to
    no more than their values hold, before a page is read (a same-size shard's page may hold a compression bomb):
    each leaf's values at most what the counts allow (a layer tokens x width, another list column 2 x tokens, a
    plain column a value a row; one more a sentence); a fixed-width leaf's page at most its values' bytes and
    VALUE_SLACK a value; a text leaf's pages beyond that at most TEXT_GROWTH x max_record_bytes a row in all (a
    row's text or id comes from one record within --max-record-bytes: a sentence's tokens, or in the token layout a
    token and its sentence's id repeated; not checked when None). ValueError or EOFError: a page header that is
    none."""
    md, rows = pf.metadata, pf.metadata.num_rows
    for i in range(md.num_columns):
        leaf = pf.schema.column(i)
        top = leaf.path.split(".", 1)[0]
        if columns is not None and top not in columns:
            continue
        limit = tokens * layer_dims[top] + sentences if top in layer_dims else \
            2 * tokens + sentences if leaf.max_repetition_level else rows
        width = leaf.length if leaf.physical_type == "FIXED_LEN_BYTE_ARRAY" else _WIDTHS.get(leaf.physical_type)
        values, text = 0, 0
        for g in range(md.num_row_groups):
            for p in column_pages(f, *chunk_span(md.row_group(g).column(i))):
                values += p.count if p.kind in (0, 3) else 0
                if values > limit or p.count > limit:
                    raise PagesExceed(f"column {leaf.path}'s pages hold more than the {limit} values its manifest "
                                      "entry allows")
                spare = p.uncompressed - p.count * ((width or 4) + VALUE_SLACK) - PAGE_SLACK
                if width is not None and spare > 0:
                    raise PagesExceed(f"a page of column {leaf.path} decompresses to {p.uncompressed} bytes, more "
                                      f"than its {p.count} values hold")
                text += max(spare, 0)
        if max_record_bytes is not None and text > rows * TEXT_GROWTH * max_record_bytes:
            raise PagesExceed(f"column {leaf.path}'s pages decompress to {text} bytes of text, more than {rows} rows "
                              f"of --max-record-bytes {max_record_bytes} make")
