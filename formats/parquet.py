"""Parquet shards: schema by layout, table building and writer settings. No Beam import.

--parquet-layout sentence (a row per sentence):
  id string "<doc id>#<index>", doc_id string, sentence_index int32, tokens list<string>,
  token_offsets list<fixed_size_list<int32, 2>> ([start, end) code points), then per layer
  layer_K list<fixed_size_list<float, D_K>> (or `average`); float is halffloat with --dtype float16.
--parquet-layout token (a row per token, for BigQuery): id, doc_id, sentence_index, token_index int32,
  token string, start int32, end int32, each layer fixed_size_list<float, D_K>.
Layer 0 is P wide (the token vector once) unless --duplicate-layer0; the others 2P (forward || backward).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ID_COLUMNS = ["id", "doc_id", "sentence_index", "token_index"]
META_COLUMNS = ("id", "doc_id", "sentence_index", "tokens")   # sentence layout, before the layer columns


def layer_columns(selection: list[int] | str, dim: int, duplicate_layer0: bool) -> list[tuple[str, int]]:
    """[(column name, vector size D)] for a layer selection (list of indices or 'average'); layer 0 has
    D = dim/2 unless duplicated."""
    if selection == "average":
        return [("average", dim)]
    return [(f"layer_{k}", dim // 2 if k == 0 and not duplicate_layer0 else dim) for k in selection]


def _vectors(arrays: list[np.ndarray], dim: int, dtype: str) -> pa.FixedSizeListArray:
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, dtype)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(dtype, copy=False)), dim)


def _list_of(values: pa.Array, lengths: list[int]) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def sentence_table(rows: list, columns: list[tuple[str, int]], dtype: str) -> pa.Table:
    """One row per sentence from rows with .item (id, doc_id, index, tokens, offsets) and .columns [(T, D_k)]."""
    lengths = [len(r.item.tokens) for r in rows]
    offsets = np.array([o for r in rows for o in r.item.offsets], dtype=np.int32).reshape(-1, 2)
    data = {
        "id": pa.array([r.item.id for r in rows], pa.string()),
        "doc_id": pa.array([r.item.doc_id for r in rows], pa.string()),
        "sentence_index": pa.array([r.item.index for r in rows], pa.int32()),
        "tokens": _list_of(pa.array([t for r in rows for t in r.item.tokens], pa.string()), lengths),
        "token_offsets": _list_of(pa.FixedSizeListArray.from_arrays(pa.array(offsets.reshape(-1)), 2), lengths),
    }
    for k, (name, dim) in enumerate(columns):
        data[name] = _list_of(_vectors([r.columns[k] for r in rows], dim, dtype), lengths)
    return pa.table(data)


def token_table(rows: list, columns: list[tuple[str, int]], dtype: str) -> pa.Table:
    """One row per token, from the same rows as sentence_table."""
    n = [len(r.item.tokens) for r in rows]
    offsets = np.array([o for r in rows for o in r.item.offsets], dtype=np.int32).reshape(-1, 2)
    data = {
        "id": pa.array([r.item.id for r, k in zip(rows, n) for _ in range(k)], pa.string()),
        "doc_id": pa.array([r.item.doc_id for r, k in zip(rows, n) for _ in range(k)], pa.string()),
        "sentence_index": pa.array(np.repeat([r.item.index for r in rows], n).astype(np.int32)),
        "token_index": pa.array(np.concatenate([np.arange(k, dtype=np.int32) for k in n]) if rows else np.zeros(0, np.int32)),
        "token": pa.array([t for r in rows for t in r.item.tokens], pa.string()),
        "start": pa.array(offsets[:, 0]),
        "end": pa.array(offsets[:, 1]),
    }
    for k, (name, dim) in enumerate(columns):
        data[name] = _vectors([r.columns[k] for r in rows], dim, dtype)
    return pa.table(data)


def build_table(rows: list, layout: str, columns: list[tuple[str, int]], dtype: str) -> pa.Table:
    return (sentence_table if layout == "sentence" else token_table)(rows, columns, dtype)


def write_parquet(table: pa.Table, f, row_group_bytes: int) -> None:
    """zstd; dictionary and statistics on id columns only; row groups of about `row_group_bytes`."""
    ids = [c for c in ID_COLUMNS + ["token"] if c in table.column_names]
    rows = max(1, int(row_group_bytes // max(1, table.nbytes / max(1, table.num_rows))))
    with pq.ParquetWriter(f, table.schema, compression="zstd", use_dictionary=["doc_id"],
                          write_statistics=ids) as w:
        w.write_table(table, row_group_size=rows)
