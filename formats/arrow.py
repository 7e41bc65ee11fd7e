"""Arrow IPC shards (--format arrow): a row per token, flat vectors, memory-mappable. No Beam import.

One uncompressed Arrow IPC file per shard, one record batch, so every column is one contiguous buffer that a
reader memory-maps and views without a copy (downstream/mapped.py):
  id              dictionary<int32, string>: the dictionary holds the shard's sentence ids (sorted), the
                  indices give each token's sentence (0, 0, 0, 1, 1, ...): the sentence index, bytes per
                  sentence, that any Arrow reader also sees as an ordinary (categorical) id column
  doc_id          dictionary<int32, string>, per token
  sentence_index  int32, per token (the sentence's index in its document)
  token           string; start, end int32 ([start, end) code points)
  layer_K         fixed_size_list<float, D_K> (halffloat with --dtype float16): no per-float levels
Layer columns and widths are those of the Parquet output (formats.parquet.layer_columns).
"""
from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa

from elmo_pipeline.formats.parquet import ShardColumns, token_fields, token_sentence_indices


def _per_token_dictionary(values: list[str], sentence_of: np.ndarray) -> pa.DictionaryArray:
    """Per-sentence strings as a per-token dictionary column: indices `sentence_of` (N,) into a dictionary
    of the distinct values in first-seen order."""
    uniq: dict[str, int] = {}
    codes = np.fromiter((uniq.setdefault(v, len(uniq)) for v in values), dtype=np.int32, count=len(values))
    return pa.DictionaryArray.from_arrays(pa.array(codes[sentence_of] if len(values) else sentence_of),
                                          pa.array(list(uniq), pa.string()))


def arrow_table(c: ShardColumns, columns: list[tuple[str, int]]) -> pa.Table:
    """One row per token (sentences sorted by id, tokens in order): id and doc_id dictionary-encoded,
    sentence_index, token, start, end, one fixed_size_list per layer (views of c.layers, no copy)."""
    sentence_of = np.repeat(np.arange(len(c.ids), dtype=np.int32), c.lengths)
    data = {
        "id": pa.DictionaryArray.from_arrays(pa.array(sentence_of), pa.array(c.ids, pa.string())),
        "doc_id": _per_token_dictionary(c.doc_ids, sentence_of),
        "sentence_index": token_sentence_indices(c),
        **token_fields(c, columns),
    }
    return pa.table(data)


def write_arrow(table: pa.Table, sink) -> None:
    """`table` as an uncompressed Arrow IPC file of one record batch; sink: a local path or a writable stream."""
    batch = table.combine_chunks().to_batches()
    with pa.ipc.new_file(sink, table.schema) as w:
        for b in batch or [pa.RecordBatch.from_pylist([], schema=table.schema)]:
            w.write_batch(b)


class BodyRefused(ValueError):
    """An Arrow IPC file whose batches are not what the writer writes: more of them, or compressed bodies."""


MAX_DICTIONARY_BATCHES = 16    # the writer's dictionary columns (id, doc_id) each write one


def check_uncompressed(data: pa.Buffer) -> None:
    """ValueError unless no record or dictionary batch of the Arrow IPC file `data` (its footer verified by
    pa.ipc.open_file) declares body compression: write_arrow writes none, and pyarrow decompresses a batch's
    buffers whole as it reads it (a same-size file may hold a bomb). Read from the footer's blocks and each message's
    metadata (flatbuffers: Footer, Message, RecordBatch.compression), never a body."""
    b = memoryview(data)
    try:
        end = len(b) - 10                                   # the footer, its int32 length, "ARROW1"
        footer = _at(b, end - struct.unpack_from("<i", b, end)[0])
        for vector, most in ((_field(b, footer, 2), MAX_DICTIONARY_BATCHES), (_field(b, footer, 3), 1)):
            if vector is None:                  # Footer.dictionaries, Footer.recordBatches (the writer's one)
                continue
            vector = _at(b, vector)
            blocks = struct.unpack_from("<I", b, vector)[0]
            if blocks > most:
                raise BodyRefused(f"its footer lists {blocks} batches of a kind the writer writes at most {most} of")
            for j in range(blocks):                                     # Block: offset, metaDataLength, bodyLength
                offset = struct.unpack_from("<q", b, vector + 4 + 24 * j)[0]
                if not 0 <= offset < len(b):
                    raise ValueError(f"a block at byte {offset}")
                if _compressed(pa.ipc.read_message(pa.BufferReader(data.slice(offset))).metadata):
                    raise BodyRefused("its batches are compressed (IPC body compression); the writer compresses none")
    except (struct.error, ValueError, IndexError, EOFError, pa.ArrowException) as e:
        if isinstance(e, BodyRefused):
            raise
        raise ValueError(f"not a readable Arrow IPC file (footer: {type(e).__name__}: {e})") from None


def _compressed(metadata: pa.Buffer) -> bool:
    """Whether a Message's RecordBatch (a DictionaryBatch's data) has its `compression` field."""
    b = memoryview(metadata)
    message = _at(b, 0)
    kind, header = _field(b, message, 1), _field(b, message, 2)     # Message.header_type, Message.header
    kind = b[kind] if kind is not None else 0
    if header is None or kind not in (2, 3):                         # 2 DictionaryBatch, 3 RecordBatch
        return False
    batch = _at(b, header)
    if kind == 2:
        data = _field(b, batch, 1)                                   # DictionaryBatch.data
        if data is None:
            return False
        batch = _at(b, data)
    return _field(b, batch, 3) is not None                           # RecordBatch.compression


def _at(b: memoryview, p: int) -> int:
    """The position a flatbuffer offset at p points to."""
    return p + struct.unpack_from("<I", b, p)[0]


def _field(b: memoryview, table: int, i: int) -> int | None:
    """The position of field i of the flatbuffer table at `table`; None when absent."""
    vtable = table - struct.unpack_from("<i", b, table)[0]
    size = struct.unpack_from("<H", b, vtable)[0]
    offset = struct.unpack_from("<H", b, vtable + 4 + 2 * i)[0] if 6 + 2 * i <= size else 0
    return table + offset if offset else None
