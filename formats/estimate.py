"""Output sizes before a run (--dry-run): the stored bytes of each layer's vectors per format and dtype, and
the bytes per token of whole files, measured by encoding a sample shard with the formats' own writers
(formats.parquet, formats.hdf5, formats.arrow: compression, offsets, tokens and per-file overhead included). No Beam import.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from elmo_pipeline.formats.arrow import arrow_table, write_arrow
from elmo_pipeline.formats.hdf5 import hdf5_bytes
from elmo_pipeline.formats.layout import STORAGE_DTYPES
from elmo_pipeline.formats.parquet import ShardColumns, build_table, parquet_bytes


def layer_bytes(columns: list[tuple[str, int]], hdf5_layers: int, hdf5_dim: int, tokens: int,
                arrow_columns: list[tuple[str, int]] = ()) -> list[dict]:
    """Per stored layer: its width and the bytes of `tokens` tokens' vectors in each dtype. Parquet stores one
    column per layer (columns [(name, D_k)]), as Arrow does (arrow_columns: the same layers); HDF5 stores
    `hdf5_layers` layers of `hdf5_dim` (AllenNLP's layout: layer 0 duplicated to 2P)."""
    rows = [{"format": fmt, "layer": name, "dim": d,
             **{dt: tokens * d * np.dtype(dt).itemsize for dt in STORAGE_DTYPES}}
            for fmt, cols in (("parquet", columns), ("arrow", arrow_columns)) for name, d in cols]
    rows += [{"format": "hdf5", "layer": f"layer {k}" if hdf5_layers > 1 else "one", "dim": hdf5_dim,
              **{dt: tokens * hdf5_dim * np.dtype(dt).itemsize for dt in STORAGE_DTYPES}} for k in range(hdf5_layers)]
    return rows


def sample_file_bytes(spec, ids: list[str], doc_ids: list[str], indices: list[int], tokens: list[list[str]],
                      offsets: list[list[tuple[int, int]]], vectors: np.ndarray, packed: np.ndarray,
                      layers: tuple[int, ...] | None = None) -> dict[str, int]:
    """{format: bytes} of one shard of these sentences, encoded as a run writes it (spec: output.staging.ShardSpec;
    vectors: the embedder's packed (L+1, N, 2P) float32, or (len(layers), N, 2P) of only `layers`; packed: offsets
    (B+1,) of each sentence in it)."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    lengths = np.array([len(tokens[i]) for i in order], np.int32)
    rows = np.concatenate([np.arange(packed[i], packed[i + 1]) for i in order]) if order else np.zeros(0, np.int64)
    cols, h5 = spec.sources(vectors, layers)
    out = {}
    if {"parquet", "arrow"} & set(spec.formats):
        c = ShardColumns([ids[i] for i in order], [doc_ids[i] for i in order], [indices[i] for i in order], lengths,
                         [t for i in order for t in tokens[i]],
                         np.array([o for i in order for o in offsets[i]], np.int32).reshape(-1, 2),
                         [np.ascontiguousarray(col[rows], dtype=spec.dtype) for col in cols])
    if "parquet" in spec.formats:
        out["parquet"] = len(parquet_bytes(build_table(c, spec.layout, list(spec.columns)), spec.row_group_bytes,
                                           spec.vector_compression))
    if "hdf5" in spec.formats:
        out["hdf5"] = len(hdf5_bytes((ids[i], np.ascontiguousarray(h5[..., packed[i]:packed[i + 1], :],
                                                                   dtype=spec.dtype)) for i in order))
    if "arrow" in spec.formats:
        sink = pa.BufferOutputStream()
        write_arrow(arrow_table(c, list(spec.columns)), sink)
        out["arrow"] = sink.getvalue().size
    return out
