"""The output as one table: pyarrow.Table or Hugging Face datasets.Dataset, for analysis. No Beam import."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from elmo_pipeline.downstream.output import ElmoOutput, open_output
from elmo_pipeline.downstream.shard_checks import check_row_lengths
from elmo_pipeline.downstream.shard_readers import PARQUET_ERRORS, unreadable
from elmo_pipeline.formats.parquet_pages import open_checked


def to_arrow_table(source: "str | ElmoOutput", columns: Sequence[str] | None = None, fmt: str | None = None,
                   storage_options: Mapping[str, Any] | None = None):
    """The output as one pyarrow.Table (the manifest's shards, in order), for analysis.

    Parquet: the stored columns as written (layer 0 P wide unless --duplicate-layer0), `columns`
    selects. HDF5 (fmt "hdf5", or an output without Parquet) and Arrow (fmt "arrow", or an output of Arrow only): id,
    doc_id, sentence_index, tokens (null from HDF5 without a Parquet twin) and one
    list<fixed_size_list<float32, 2P>> column per layer (layer 0 duplicated, as stored in HDF5), a row a sentence.
    """
    import pyarrow as pa
    out = open_output(source, storage_options)
    fmt = fmt or out.default_format()
    if fmt == "parquet":
        tables = []
        for i in range(len(out.shards)):
            path = out.shard_path(i, "parquet", check=True)
            with out.fs.open(path, "rb") as f, unreadable(path, "Parquet", PARQUET_ERRORS):
                pf = open_checked(f)
                names = pf.schema_arrow.names
                unknown = [c for c in columns or () if c not in names]
                if not unknown:
                    tables.append(_read_checked(pf, f, path, out, i, list(columns) if columns else None))
            if unknown:         # the caller's mistake, not a damaged shard (unreadable's ValueError)
                raise ValueError(f"{out.shown}: no column(s) {unknown} (has {names})")
        if not tables:          # no sentence: the empty table of its shards' schema, as a shard reads back
            import pyarrow.parquet as pq
            from elmo_pipeline.formats.parquet import parquet_bytes, shard_schema
            schema = shard_schema(out.parquet_layout, list(out.layer_dims.items()), out.dtype)
            empty = pq.read_table(pa.BufferReader(parquet_bytes(schema.empty_table(), 1 << 20)))
            unknown = [c for c in columns or () if c not in empty.schema.names]
            if unknown:
                raise ValueError(f"{out.shown}: no column(s) {unknown} (has {empty.schema.names})")
            return empty.select(list(columns)) if columns else empty
        return pa.concat_tables(tables)
    recs = list(out.sentences(fmt))
    data = {"id": pa.array([r["id"] for r in recs], pa.string()),
            "doc_id": pa.array([r["doc_id"] for r in recs], pa.string()),
            "sentence_index": pa.array([r["sentence_index"] for r in recs], pa.int32()),
            "tokens": pa.array([r["tokens"] for r in recs], pa.list_(pa.string()))}
    lengths = np.array([r["layers"].shape[1] for r in recs], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    for k, name in enumerate(out.layer_names):
        flat = np.concatenate([r["layers"][k].reshape(-1) for r in recs]) if recs else np.zeros(0, np.float32)
        data[name] = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(flat), out.dim))
    table = pa.table(data)
    return table.select(list(columns)) if columns else table


def _read_checked(pf, f, path: str, out: ElmoOutput, i: int, columns: list[str] | None):
    """The `columns` (None: all) of shard i's opened Parquet file, checked against the manifest before a page is
    read (ElmoOutput.parquet_check); in the sentence layout each layer row read checked to hold a vector per token
    (its `tokens` read for that when not asked for)."""
    layers = [n for n in out.layer_names if columns is None or n in columns]
    if out.parquet_layout != "sentence" or not layers:
        out.parquet_check(i, path)(pf, f, columns)
        return pf.read(columns=columns)
    read = columns if columns is None or "tokens" in columns else [*columns, "tokens"]
    out.parquet_check(i, path)(pf, f, read)
    t = pf.read(columns=read)
    check_row_lengths(t, path, layers)
    return t if columns is None else t.select(columns)


def to_hf_dataset(source: "str | ElmoOutput", columns: Sequence[str] | None = None, fmt: str | None = None,
                  storage_options: Mapping[str, Any] | None = None):
    """The output as a Hugging Face `datasets.Dataset` (in memory, over to_arrow_table's table; no
    download, no cache files). Layer columns become nested sequences of float; use
    `.with_format("torch")` or `"numpy"` for tensors."""
    import datasets
    return datasets.Dataset(to_arrow_table(source, columns, fmt, storage_options))
