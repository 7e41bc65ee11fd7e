"""Reading documents from text, JSONL and Parquet files (local paths or fsspec URLs). No Beam import.

Lines and compression: transforms.lines; ids (file labels, --id-field values): transforms.ids.
"""
from __future__ import annotations

import json
from typing import Iterator

from elmo_pipeline.formats.layout import EXCERPT_CHARS, DeadLetter
from elmo_pipeline.fsio import open_file, redact, storage_error
from elmo_pipeline.transforms.ids import JSON_TYPES, BadId, document_id, printable_label
from elmo_pipeline.transforms.lines import (CORRUPT, Corrupt, Meter, TooLong, lines_until_corrupt, open_decompressed,
                                            utf8_lines)
from elmo_pipeline.formats.parquet_pages import chunk_span, column_pages, open_checked
from elmo_pipeline.transforms.records import Blank, Document
from elmo_pipeline.transforms.splits import Range, Split

INPUT_FORMATS = ("text", "lines", "jsonl", "parquet")


def decode_line(raw: bytes, record_id: str) -> str | DeadLetter:
    """A line's bytes as text (strict UTF-8), or a record dead letter "invalid UTF-8" naming the byte offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DeadLetter(record_id, f"invalid UTF-8: {e.reason} at byte {e.start} of the line",
                          raw.decode("utf-8", "replace")[:EXCERPT_CHARS], level="record")


MAX_RECORD_BYTES = 8 << 20          # --max-record-bytes default


def read_documents(url: str, fmt: str, label: str, text_field: str = "text", id_field: str | None = None,
                   storage_options: dict | None = None, max_record_bytes: int = MAX_RECORD_BYTES,
                   split: Split | None = None) -> Iterator[Document | DeadLetter | Blank]:
    """Every record of one file, in file order: a Document, a Blank (whitespace-only) or a DeadLetter; of
    its part `split` only (transforms.splits: whole lines or row groups, numbered as in the whole file).

    Lines are split on b"\\n" only and decoded one by one as strict UTF-8 (a line that is not valid
    UTF-8 is a dead letter, its neighbours are unaffected); a trailing "\\r" is dropped (CRLF files),
    and so is a UTF-8 byte-order mark at the start of the file. A file that is not UTF-8 text with LF or CRLF
    line ends (transforms.lines.not_utf8_lines) is one record dead letter "unreadable file", never read. A
    record over `max_record_bytes` is a dead letter "too long", read in blocks and never held whole. A failure
    that is not a storage error (those propagate, fsio.storage_error: the runner retries the file) ends the file
    with one record dead letter "unreadable file" for the rest of it (of the part, for a split); the records
    before it stand (its reason redacted: an exception's text may quote the URL)."""
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {fmt!r}")
    label = printable_label(label)
    part = split if split is not None and not split.whole else None
    n = part.first - 1 if part else 0
    try:
        for rec in _file_records(url, fmt, label, text_field, id_field, storage_options, max_record_bytes, part):
            n += 1
            yield rec
    except Exception as e:  # noqa: BLE001 - one file must not fail the run; storage errors are re-raised
        if storage_error(e) and not isinstance(e, CORRUPT):
            raise
        rest = f"the rest of part {part.part + 1} of {part.parts} of the file" if part else "the rest of the file"
        yield DeadLetter(f"{label}:{n + 1}", f"unreadable file: after record {n}, {rest} is lost: "
                         f"{type(e).__name__}: {redact(' '.join(str(e).split()))}"[:500], "", level="record")


def _file_records(url, fmt, label, text_field, id_field, storage_options, max_record_bytes, part: Split | None):
    if fmt == "parquet":
        yield from _read_parquet(url, label, text_field, id_field, storage_options, max_record_bytes, part)
        return
    if part:        # uncompressed: its bytes [start, end), whole lines
        with open_file(url, "rb", storage_options) as raw:
            meter = Meter(Range(raw, part.start, part.end))
            yield from line_records(meter, meter, fmt, label, text_field, id_field, max_record_bytes,
                                    whole_file=part.start == 0, first=part.first)
        return
    with open_decompressed(url, storage_options) as (f, meter):
        yield from line_records(f, meter, fmt, label, text_field, id_field, max_record_bytes)


def too_long(nbytes: int, max_record_bytes: int, what: str = "record") -> str:
    """The reason of a record dead letter over --max-record-bytes (`what`: the record, or its id cell)."""
    return f"too long: {what} of {nbytes} bytes > --max-record-bytes {max_record_bytes}"


def line_records(f, meter: Meter, fmt: str, label: str, text_field: str, id_field: str | None,
                  max_record_bytes: int = MAX_RECORD_BYTES, whole_file: bool = True, first: int = 1):
    """The records of a line format (text, lines, jsonl); each Document's nbytes is the bytes of the stored
    file read since the previous Document (so read-ahead and skipped records count with the next one).
    `whole_file`: f starts at the file's start, so the file-level check applies (transforms.lines.utf8_lines);
    `first`: the line number of f's first line."""
    done = 0
    raws = lines_until_corrupt(f, max_record_bytes)
    for n, raw in enumerate(utf8_lines(raws) if whole_file else raws, first):
        default_id = f"{label}:{n}"
        if isinstance(raw, Corrupt):     # one record dead letter for the unreadable (rest of the) file
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
            raise TypeError(f"the line is {JSON_TYPES.get(type(record), 'a ' + type(record).__name__)}, "
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


BATCH_BYTES = 64 << 20      # Parquet rows are read in batches of about this many bytes of text (at most 4096 rows)


def parquet_columns(url: str, storage_options: dict | None = None) -> list[str]:
    """The column names of a Parquet file, from its footer (one small read)."""
    import pyarrow.parquet as pq
    with open_file(url, "rb", storage_options) as f:
        return pq.ParquetFile(f).schema_arrow.names


def _read_parquet(url, label, text_field, id_field, storage_options, max_record_bytes: int = MAX_RECORD_BYTES,
                  part: Split | None = None) -> Iterator[Document | DeadLetter | Blank]:
    """The rows of a Parquet file (of row groups [part.start, part.end) only, numbered as in the file); a text
    over max_record_bytes (UTF-8) is a dead letter "too long" (left out of the batch before it becomes a Python
    string) and an --id-field cell follows document_id(). A row group with a text or id page over
    PAGE_RECORDS * max_record_bytes is never decoded (pyarrow decompresses a whole page to read any value of it):
    each of its rows is a dead letter "too long: Parquet page ...". Only a flat text (or id: text or integer)
    column is ever decoded, its own leaf alone (_value_leaf): any other field's rows are dead letters by its type,
    whatever its values."""
    with open_file(url, "rb", storage_options) as f:
        size = f.seek(0, 2)         # row n's share of the file's bytes: size * n // rows - size * (n - 1) // rows
        f.seek(0)
        pf = open_checked(f)
        rows = max(1, pf.metadata.num_rows)
        n = part.first - 1 if part else 0
        done = size * n // rows
        columns = [text_field] + ([id_field] if id_field else [])
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"no column(s) {missing} (has {names})")
        text_leaf = _value_leaf(pf, text_field)
        id_leaf = _value_leaf(pf, id_field, integers=True) if id_field else None
        no_text = f"unreadable record: {text_field!r} is null" if text_leaf is not None else \
            f"unreadable record: {text_field!r} is {_type_name(pf, text_field)}, not a string"
        no_id = id_field and id_leaf is None and \
            f"bad id: {id_field!r} is {_type_name(pf, id_field)}, not a string or an integer"
        read = {} if no_id else {c: i for c, i in ((text_field, text_leaf), (id_field, id_leaf)) if i is not None}
        dictionary = [c for c, i in read.items() if _dictionary_pages(pf, i)]
        if dictionary:
            f.seek(0)       # read as dictionary: one copy of each distinct value, never one per row
            pf = open_checked(f, read_dictionary=dictionary)
        mine = range(part.start, part.end) if part else range(pf.metadata.num_row_groups)
        indices = sorted(set(read.values()))
        for groups, reason, batch_rows in _row_group_runs(pf, f, indices, set(dictionary), max_record_bytes, mine):
            if reason or not indices:   # a page too big to decode, or no column to decode: no value is read
                for _ in range(sum(pf.metadata.row_group(g).num_rows for g in groups)):
                    n += 1
                    yield DeadLetter(f"{label}:{n}", reason or no_id or no_text, "", level="record")
                continue
            for batch in pf.reader.iter_batches(batch_rows, row_groups=groups, column_indices=indices):
                none = ([None] * batch.num_rows,) * 2
                texts, lengths = _texts_within(batch.column(text_field), max_record_bytes) \
                    if text_leaf is not None else none
                ids, id_lengths = _texts_within(batch.column(id_field), max_record_bytes) if id_field else none
                for text, raw_id, nbytes, id_nbytes in zip(texts, ids, lengths, id_lengths):
                    n += 1
                    upto = size * n // rows
                    record = _parquet_record(text, raw_id, nbytes, f"{label}:{n}", text_field, id_field,
                                             max_record_bytes, upto - done, id_nbytes, no_text)
                    if isinstance(record, Document):
                        done = upto
                    yield record


PAGE_RECORDS = 4    # a Parquet page over this many --max-record-bytes is never decoded (the memory bound)


def _row_group_runs(pf, f, leaves: list[int], dictionary: set[str], max_record_bytes: int,
                    groups: range) -> Iterator[tuple[list[int], str | None, int]]:
    """The row groups `groups` of the file in order, lazily: (a run of groups to read, None, rows per batch), or
    ([group], the reason, 0) for a group with a page of the flat leaf columns `leaves` over
    PAGE_RECORDS * max_record_bytes uncompressed. Every page header of those leaves is read, a group when it is
    next (formats.parquet_pages): the sizes pyarrow decompresses, whatever the footer says. Rows per batch keep
    a batch's values within about BATCH_BYTES at the group's densest pages (_bytes_a_row); a run ends at about
    BATCH_BYTES or 4096 rows, so a reader looks ahead no further."""
    md, limit = pf.metadata, PAGE_RECORDS * max_record_bytes
    run, run_rows, run_bytes, run_count = [], 4096, 0, 0
    for g in groups:
        over, per_row, nbytes = None, 0.0, 0
        for i in leaves:
            path = pf.schema.column(i).path
            over, row, size = _bytes_a_row(column_pages(f, *chunk_span(md.row_group(g).column(i))), limit,
                                           path in dictionary)
            if over:
                over = (f"too long: Parquet page of {over} bytes > {PAGE_RECORDS}x --max-record-bytes "
                        f"{max_record_bytes} (column {path!r}, row group {g}); the row group is not read (a "
                        "larger --max-record-bytes reads it)")
                break
            per_row, nbytes = per_row + row, nbytes + size
        if over:
            if run:
                yield run, None, run_rows
                run, run_rows, run_bytes, run_count = [], 4096, 0, 0
            yield [g], over, 0
            continue
        run.append(g)
        run_rows = min(run_rows, int(max(1, min(4096, BATCH_BYTES // max(per_row, 1.0)))))
        run_bytes, run_count = run_bytes + nbytes, run_count + md.row_group(g).num_rows
        if run_bytes >= BATCH_BYTES or run_count >= 4096:
            yield run, None, run_rows
            run, run_rows, run_bytes, run_count = [], 4096, 0, 0
    if run:
        yield run, None, run_rows


def _value_leaf(pf, name: str, integers: bool = False) -> int | None:
    """The index of the Parquet leaf column that is the field `name` itself when it is flat (one value a row) and
    text, or with `integers` (an id) integers too; else None: a nested or other field, whose values are never
    decoded (its rows are dead letters whatever they hold, by its type: _type_name). Read by index, the leaf alone
    (by name pyarrow would also decode a struct `text`'s child `x` for a flat column `text.x`)."""
    import pyarrow as pa
    fields = [fld for fld in pf.schema_arrow if fld.name == name]
    leaves = [i for i, path in enumerate(pf.reader.column_paths) if path == [name]]
    if len(fields) != 1 or len(leaves) != 1:
        return None
    t = fields[0].type.value_type if pa.types.is_dictionary(fields[0].type) else fields[0].type
    return leaves[0] if _is_text(t) or integers and pa.types.is_integer(t) else None


def _type_name(pf, name: str) -> str:
    """The Arrow type of the field `name` for a dead letter's reason, at most 100 characters."""
    types = [str(fld.type) for fld in pf.schema_arrow if fld.name == name]
    text = types[0] if len(types) == 1 else f"{len(types)} columns"
    return text if len(text) <= 100 else text[:97] + "..."


def _bytes_a_row(pages, limit: int, as_dictionary: bool) -> tuple[int, float, int]:
    """(the uncompressed bytes of the chunk's first page over `limit`, else 0; the most bytes a row of its pages
    decodes to; the pages' uncompressed bytes), from the page headers of a flat column's chunk. A data page's
    bytes a row are its bytes over its num_values (one a row); a dictionary page's bytes are added to each row
    unless the column is read as a dictionary (a row may then decode to its largest value)."""
    most, dictionary, total = 0.0, 0, 0
    for p in pages:
        if p.uncompressed > limit:
            return p.uncompressed, 0.0, 0
        total += p.uncompressed
        if p.kind == 2:
            dictionary = max(dictionary, p.uncompressed)
        elif p.kind != 1:               # an index page decodes to no row
            most = max(most, p.uncompressed / max(p.count, 1))
    return 0, most + (0 if as_dictionary else dictionary), total


def _dictionary_pages(pf, leaf: int) -> bool:
    """Whether any row group stores the flat leaf column `leaf` dictionary-encoded (from the footer)."""
    md = pf.metadata
    return any(md.row_group(g).column(leaf).has_dictionary_page for g in range(md.num_row_groups))


def _is_text(t) -> bool:
    import pyarrow as pa
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _texts_within(column, max_record_bytes: int) -> tuple[list, list]:
    """(Python values of a text column, each value's UTF-8 bytes or None); a value over max_record_bytes
    comes out as None (never made a Python string). A dictionary column's lengths are its distinct values'
    and each value within the cap becomes one Python string, shared by its rows."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if pa.types.is_dictionary(column.type) and _is_text(column.type.value_type):
        if pa.types.is_string_view(column.type.value_type):
            column = column.cast(pa.dictionary(column.type.index_type, pa.large_string()))
        sizes = pc.binary_length(column.dictionary).to_pylist()
        values: dict[int, str] = {}
        texts, lengths = [], []
        for i in column.indices.to_pylist():
            if i is None or sizes[i] is None:
                texts.append(None)
                lengths.append(None)
                continue
            if sizes[i] <= max_record_bytes and i not in values:
                values[i] = column.dictionary[i].as_py()
            texts.append(values.get(i))
            lengths.append(sizes[i])
        return texts, lengths
    if not _is_text(column.type):       # an integer id
        return column.to_pylist(), [None] * len(column)
    if pa.types.is_string_view(column.type):
        column = column.cast(pa.large_string())
    lengths = pc.binary_length(column)
    over = pc.greater(lengths, max_record_bytes)
    if pc.any(over).as_py():
        column = pc.if_else(over, pa.scalar(None, column.type), column)
    return column.to_pylist(), lengths.to_pylist()


def _parquet_record(text, raw_id, nbytes: int | None, default_id: str, text_field: str, id_field: str | None,
                    max_record_bytes: int, share: int, id_nbytes: int | None = None,
                    no_text: str = "") -> Document | DeadLetter | Blank:
    """One Parquet row's record: text None when it is null, was left out for being over max_record_bytes (nbytes:
    its UTF-8 bytes) or its column is no text column (no_text: the reason then); share: its bytes of the file
    (progress); raw_id None and id_nbytes over max_record_bytes when the id cell was left out for the same reason."""
    if id_nbytes is not None and id_nbytes > max_record_bytes:
        return DeadLetter(default_id, too_long(id_nbytes, max_record_bytes, f"id {id_field!r}"), "", level="record")
    try:
        doc_id = document_id(raw_id, id_field) if id_field else default_id
    except BadId as e:
        return DeadLetter(default_id, str(e), text[:EXCERPT_CHARS] if isinstance(text, str) else "",
                          level="record")
    if nbytes is not None and nbytes > max_record_bytes:
        return DeadLetter(doc_id, too_long(nbytes, max_record_bytes), "", level="record")
    if not isinstance(text, str):
        return DeadLetter(doc_id, no_text or f"unreadable record: {text_field!r} is null", "", level="record")
    if not text.strip():
        return Blank(doc_id)
    return Document(doc_id, text, source=default_id if id_field else "", nbytes=share)
