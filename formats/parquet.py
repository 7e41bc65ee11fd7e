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

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ID_COLUMNS = ["id", "doc_id", "sentence_index", "token_index"]
META_COLUMNS = ("id", "doc_id", "sentence_index", "tokens")   # sentence layout, before the layer columns
TOKEN_META_COLUMNS = (*ID_COLUMNS, "token")                      # token layout, before start, end and the layers
VECTOR_PREFIXES = ("layer_", "average")                          # the vector columns
# --vector-compression: uncompressed float vectors encode fastest and every reader reads them unchanged; zstd
# trades encoding CPU for size (both measured by benchmarks/host_cost.py, see benchmarks/README.md).
VECTOR_COMPRESSIONS = ("none", "zstd", "lz4", "snappy")


def layer_columns(selection: list[int] | str, dim: int, duplicate_layer0: bool) -> list[tuple[str, int]]:
    """[(column name, vector size D)] for a layer selection (list of indices or 'average'); layer 0 has
    D = dim/2 unless duplicated."""
    if selection == "average":
        return [("average", dim)]
    return [(f"layer_{k}", dim // 2 if k == 0 and not duplicate_layer0 else dim) for k in selection]


@dataclass
class ShardColumns:
    """A shard's content, columnar, sentences sorted by id; what its Parquet file is built from.
    ids, doc_ids, indices: per sentence (S); lengths int32 (S,) tokens per sentence; tokens: flat (N);
    offsets int32 (N, 2) [start, end); layers: per column a (N, D_k) array in the storage dtype."""
    ids: list[str]
    doc_ids: list[str]
    indices: list[int]
    lengths: np.ndarray
    tokens: list[str]
    offsets: np.ndarray
    layers: list[np.ndarray]


def _fixed(values: np.ndarray, dim: int) -> pa.FixedSizeListArray:
    """(N, dim) -> fixed_size_list<dim>, without a copy (the array must be C-contiguous)."""
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dim)


def _list_of(values: pa.Array, lengths: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def sentence_table(c: ShardColumns, columns: list[tuple[str, int]]) -> pa.Table:
    """One row per sentence: id, doc_id, sentence_index, tokens, token_offsets, one list<fixed_size_list> per layer."""
    data = {
        "id": pa.array(c.ids, pa.string()),
        "doc_id": pa.array(c.doc_ids, pa.string()),
        "sentence_index": pa.array(c.indices, pa.int32()),
        "tokens": _list_of(pa.array(c.tokens, pa.string()), c.lengths),
        "token_offsets": _list_of(_fixed(c.offsets, 2), c.lengths),
    }
    for (name, dim), values in zip(columns, c.layers):
        data[name] = _list_of(_fixed(values, dim), c.lengths)
    return pa.table(data)


def token_table(c: ShardColumns, columns: list[tuple[str, int]]) -> pa.Table:
    """One row per token: id (sentence), doc_id, sentence_index, token_index, token, start, end, one
    fixed_size_list per layer."""
    sentence_of = pa.array(np.repeat(np.arange(len(c.ids), dtype=np.int32), c.lengths))
    starts = np.repeat(np.cumsum(c.lengths) - c.lengths, c.lengths)
    data = {
        "id": pa.array(c.ids, pa.string()).take(sentence_of),
        "doc_id": pa.array(c.doc_ids, pa.string()).take(sentence_of),
        "sentence_index": token_sentence_indices(c),
        "token_index": pa.array((np.arange(len(c.tokens)) - starts).astype(np.int32)),
        **token_fields(c, columns),
    }
    return pa.table(data)


def token_sentence_indices(c: ShardColumns) -> pa.Array:
    """int32 (N,): each token's sentence index in its document."""
    return pa.array(np.repeat(np.asarray(c.indices, dtype=np.int32), c.lengths))


def token_fields(c: ShardColumns, columns: list[tuple[str, int]]) -> dict[str, pa.Array]:
    """The per-token columns after the ids, in order: token, start, end (code points), then each layer as
    fixed_size_list<float, D> (views of c.layers, no copy)."""
    data = {"token": pa.array(c.tokens, pa.string()), "start": pa.array(np.ascontiguousarray(c.offsets[:, 0])),
            "end": pa.array(np.ascontiguousarray(c.offsets[:, 1]))}
    for (name, dim), values in zip(columns, c.layers):
        data[name] = _fixed(values, dim)
    return data


def build_table(c: ShardColumns, layout: str, columns: list[tuple[str, int]]) -> pa.Table:
    return (sentence_table if layout == "sentence" else token_table)(c, columns)


def shard_schema(layout: str, columns: list[tuple[str, int]], dtype: str) -> pa.Schema:
    """The Arrow schema of every Parquet shard of a run (that of an empty shard built the same way), known
    before the run: what an Iceberg table of the output is created from and checked against."""
    empty = ShardColumns([], [], [], np.zeros(0, np.int32), [], np.zeros((0, 2), np.int32),
                         [np.zeros((0, d), dtype) for _, d in columns])
    return build_table(empty, layout, columns).schema


def _leaf_paths(name: str, typ: pa.DataType) -> list[str]:
    """Parquet's column paths under a field (per-column writer settings take leaf paths): 'tokens.list.element'."""
    if pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ) or pa.types.is_large_list(typ):
        return _leaf_paths(f"{name}.list.element", typ.value_type)
    return [name]


def parquet_bytes(table: pa.Table, row_group_bytes: int, vector_compression: str = "none") -> pa.Buffer:
    """The Parquet file of `table` (write_parquet's settings), encoded in memory without the GIL."""
    sink = pa.BufferOutputStream()
    write_parquet(table, sink, row_group_bytes, vector_compression)
    return sink.getvalue()


def vector_leaves(schema: pa.Schema) -> list[str]:
    """The Parquet leaf paths of the vector columns: 'layer_1.list.element'."""
    return [leaf for f in schema if f.name.startswith(VECTOR_PREFIXES) for leaf in _leaf_paths(f.name, f.type)]


def writer_options(schema: pa.Schema, vector_compression: str = "none") -> dict:
    """pq.ParquetWriter's settings for a shard: pyarrow's defaults elsewhere (page size, batch size, page
    version and plain encoding measured no slower: docs/decisions/parquet-settings.md)."""
    vectors = set(vector_leaves(schema))
    return dict(compression={leaf: vector_compression if leaf in vectors else "zstd"
                             for f in schema for leaf in _leaf_paths(f.name, f.type)},
                use_dictionary=["doc_id"],
                write_statistics=[c for c in ID_COLUMNS + ["token"] if c in schema.names])


KEY_INDEX_SCHEMA = pa.schema([("id", pa.string()), ("key", pa.string())])


def write_key_index(ids: list[str], keys: list[str], f) -> None:
    """A shard's key index: its sentence ids and sentence keys (model.resolve.sentence_key), row r of the shard
    being row r here; zstd, statistics on both columns (a join by key range skips row groups)."""
    pq.write_table(pa.table([pa.array(ids, pa.string()), pa.array(keys, pa.string())], schema=KEY_INDEX_SCHEMA),
                   f, compression="zstd")


def write_parquet(table: pa.Table, f, row_group_bytes: int, vector_compression: str = "none") -> None:
    """Text and id columns zstd, vector columns `vector_compression` (VECTOR_COMPRESSIONS); dictionary on
    doc_id only, statistics on id columns only; row groups of about `row_group_bytes`. `f`: a file object,
    an Arrow stream or a local path (encoded straight into the file, no in-memory copy)."""
    rows = max(1, int(row_group_bytes // max(1, table.nbytes / max(1, table.num_rows))))
    with pq.ParquetWriter(f, table.schema, **writer_options(table.schema, vector_compression)) as w:
        w.write_table(table, row_group_size=rows)
