"""Staging: the workers' side of the output folder (formats.layout). No Beam import.

Shards are written under <out>/_staging/<run key>/ first, each followed by a commit record
(committed/<name>.json, written atomically after the shard's files: a staged file without one is
garbage); dead letters, per-file record counts and run statistics are staged beside them. Finalize (transforms/finalize.py)
turns what is staged into the final output.
"""
from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass

import numpy as np

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.arrow import arrow_bytes, arrow_table, write_arrow
from elmo_pipeline.formats.hdf5 import hdf5_bytes
from elmo_pipeline.formats.layout import DEAD, RECORDS, ShardInfo
from elmo_pipeline.formats.parquet import ShardColumns, build_table, parquet_bytes, write_parquet
from elmo_pipeline.fsio import atomic_write, is_local_fs, makedirs, release_written, url_fs
from elmo_pipeline.transforms.faults import crash_point
from elmo_pipeline.transforms.records import EmbeddedBatch


@dataclass(frozen=True)
class ShardSpec:
    """How shards are written: formats, Parquet layout and columns [(name, D_k)], the layer selection
    (indices or 'average') out of the embedder's L+1 layers, storage dtype, Parquet row-group size."""
    formats: tuple[str, ...]
    layout: str
    columns: tuple[tuple[str, int], ...]
    selection: tuple[int, ...] | str
    duplicate_layer0: bool
    dtype: str
    row_group_bytes: int
    n_layers: int                       # L + 1
    dim: int                            # 2P
    vector_compression: str = "none"    # Parquet vector columns (formats.parquet.VECTOR_COMPRESSIONS)

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token's vectors over all formats (a shard's memory bound counts these)."""
        item = np.dtype(self.dtype).itemsize
        flat = sum(d for _, d in self.columns) * sum(f in self.formats for f in ("parquet", "arrow"))
        h5 = 0
        if "hdf5" in self.formats:
            h5 = self.dim if self.selection == "average" or len(self.selection) == 1 and \
                self.selection[0] == self.n_layers - 1 else len(self.selection) * self.dim
        return (flat + h5) * item

    @property
    def layers_read(self) -> tuple[int, ...] | None:
        """The layers sources() reads, ascending; None for all (every layer, or their average)."""
        if self.selection == "average" or sorted(set(self.selection)) == list(range(self.n_layers)):
            return None
        return tuple(sorted(set(self.selection)))

    def sources(self, vectors: np.ndarray, layers: tuple[int, ...] | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """Views of one batch's packed vectors (L+1, N, 2P), or (len(layers), N, 2P) holding only `layers`: per
        Parquet column (N, D_k), and the HDF5 source in AllenNLP's layout, (layers, N, 2P) or (N, 2P) for
        top/average (layer 0 duplicated)."""
        sel = self.selection
        if sel == "average":
            avg = vectors.mean(axis=0)
            return [avg], avg
        layer = vectors if layers is None else dict(zip(layers, vectors))    # layer k -> (N, 2P)
        half = vectors.shape[2] // 2
        cols = [layer[0][:, :half] if k == 0 and not self.duplicate_layer0 else layer[k] for k in sel]
        if list(sel) == [self.n_layers - 1]:
            h5 = layer[self.n_layers - 1]
        elif list(sel) == list(range(self.n_layers)):
            h5 = vectors                        # all layers in order: no copy
        elif layers is None:
            h5 = vectors[list(sel)]
        else:
            h5 = np.stack([layer[k] for k in sel])
        return cols, h5


def shard_columns(sentences: list[tuple[EmbeddedBatch, int]], spec: ShardSpec) -> ShardColumns:
    """The shard's Parquet content from (batch, sentence index) pairs already sorted by id: each layer is
    one (N, D_k) array in the storage dtype, filled by one copy per sentence from the batches' vectors."""
    sources = {id(b): spec.sources(b.vectors, b.layers)[0] for b, _ in sentences}
    lengths = np.fromiter((b.tokens(i) for b, i in sentences), dtype=np.int32, count=len(sentences))
    n = int(lengths.sum())
    layers = [np.empty((n, d), dtype=spec.dtype) for _, d in spec.columns]
    pos = 0
    for (batch, i), t in zip(sentences, lengths):
        a = int(batch.offsets[i])
        for out, src in zip(layers, sources[id(batch)]):
            out[pos: pos + t] = src[a: a + t]
        pos += t
    items = [b.items[i] for b, i in sentences]
    offsets = np.array([o for it in items for o in it.offsets], dtype=np.int32).reshape(-1, 2)
    return ShardColumns([it.id for it in items], [it.doc_id for it in items], [it.index for it in items],
                        lengths, [t for it in items for t in it.tokens], offsets, layers)


def hdf5_sentences(sentences: list[tuple[EmbeddedBatch, int]], spec: ShardSpec):
    """(sentence id, (layers, T, 2P) or (T, 2P) array in the storage dtype) per sentence, AllenNLP's layout."""
    sources = {id(b): spec.sources(b.vectors, b.layers)[1] for b, _ in sentences}
    for batch, i in sentences:
        a, e = int(batch.offsets[i]), int(batch.offsets[i + 1])
        src = sources[id(batch)]
        yield batch.items[i].id, np.ascontiguousarray(src[..., a:e, :], dtype=spec.dtype)


def stage_shard(sentences: list[tuple[EmbeddedBatch, int]], staging: str, spec: ShardSpec,
                storage_options: dict | None = None) -> ShardInfo:
    """Write one shard of (batch, sentence index) pairs, sorted by sentence id, under the staging URL (uuid
    names), then its commit record (committed/<name>.json: file names, counts, sentence ids)."""
    sentences = sorted(sentences, key=lambda p: p[0].items[p[1]].id)
    ids = [b.items[i].id for b, i in sentences]
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, root)
    name = uuid.uuid4().hex
    files = {}
    columns = shard_columns(sentences, spec) if {"parquet", "arrow"} & set(spec.formats) else None
    if "parquet" in spec.formats:
        table = build_table(columns, spec.layout, list(spec.columns))
        files["parquet"] = posixpath.join(root, name + ".parquet")
        if is_local_fs(fs):     # encoded straight into the file by Arrow's own writer, without the GIL
            write_parquet(table, files["parquet"], spec.row_group_bytes, spec.vector_compression,
                          before_close=lambda: crash_point("stage_shard"))
        else:                   # one PUT of the encoded bytes
            data = parquet_bytes(table, spec.row_group_bytes, spec.vector_compression)
            with fs.open(files["parquet"], "wb") as f:
                f.write(data[: len(data) // 2])
                crash_point("stage_shard")
                f.write(data[len(data) // 2:])
    if "arrow" in spec.formats:
        files["arrow"] = posixpath.join(root, name + ".arrow")
        if is_local_fs(fs):
            write_arrow(arrow_table(columns, list(spec.columns)), files["arrow"])
        else:
            fs.pipe_file(files["arrow"], arrow_bytes(arrow_table(columns, list(spec.columns))))
    if "hdf5" in spec.formats:
        files["hdf5"] = posixpath.join(root, name + ".hdf5")
        fs.pipe_file(files["hdf5"], hdf5_bytes(hdf5_sentences(sentences, spec)))
    for path in files.values():
        release_written(fs, path)
    lengths = np.fromiter((b.tokens(i) for b, i in sentences), dtype=np.int64, count=len(sentences))
    info = ShardInfo(files, len(sentences), int(lengths.sum()), ids[0])
    histogram = dict(zip(*(a.tolist() for a in np.unique(lengths, return_counts=True))))
    makedirs(fs, posixpath.join(root, RECORDS))
    atomic_write(fs, posixpath.join(root, RECORDS, name + ".json"), json.dumps(info.record(ids, histogram)).encode())
    crash_point("commit")
    return info


def stage_dead_letters(letters: list[layout.DeadLetter], staging: str, storage_options: dict | None = None) -> str:
    """Write dead letters as one staged JSONL file (dead/<uuid>.jsonl, whole or not at all); returns its path.
    A retried bundle stages its letters again: Finalize drops the duplicates (transforms/finalize.py)."""
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, posixpath.join(root, DEAD))
    path = posixpath.join(root, DEAD, uuid.uuid4().hex + ".jsonl")
    atomic_write(fs, path, "".join(d.to_json() + "\n" for d in letters).encode("utf-8"))
    return path


def stage_stats(stats: dict, staging: str, storage_options: dict | None = None) -> None:
    """Stage a bundle's run statistics (stats/<uuid>.json, transforms/stats.py) for the run report."""
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, posixpath.join(root, layout.STATS))
    atomic_write(fs, posixpath.join(root, layout.STATS, uuid.uuid4().hex + ".json"), json.dumps(stats).encode())


def stage_counts(url: str, counts: dict, staging: str, storage_options: dict | None = None) -> None:
    """Stage the record counts of input file `url` (counts/<hash>.json: one name per file, so a retried read
    rewrites the same object with the same content)."""
    fs, root = url_fs(staging, storage_options)
    path = posixpath.join(root, layout.counts_name(url))
    makedirs(fs, posixpath.dirname(path))
    atomic_write(fs, path, json.dumps({"url": url, **counts}).encode())
