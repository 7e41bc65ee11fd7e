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
