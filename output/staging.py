"""Staging: the workers' side of the output protocol (output/names.py). No Beam import.

Shards are written under <out>/_staging/<run key>/ first, each followed by a commit record
(committed/<name>.json, written atomically after the shard's files: a staged file without one is
garbage); dead letters, per-file record counts and run statistics are staged beside them, all through a
fenced Sink (output/sink.py), so a run that lost the output's lease stages nothing more. Finalize
(output/finalize.py) turns what is staged into the final output.
"""
from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.arrow import arrow_table, write_arrow
from elmo_pipeline.formats.hdf5 import hdf5_bytes
from elmo_pipeline.formats.layout import ShardInfo
from elmo_pipeline.formats.parquet import ShardColumns, build_table, write_key_index, write_parquet
from elmo_pipeline.model.resolve import sentence_key
from elmo_pipeline.output.names import DEAD, DOCS, KEYS, RECORDS, STATS, counts_name
from elmo_pipeline.output.sink import Sink


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
    key_prefix: str | None = None       # the model's (model.resolve.ModelSpec.key_prefix): a key index per shard

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


def shard_columns(sentences: list[tuple], spec: ShardSpec) -> ShardColumns:
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


def hdf5_sentences(sentences: list[tuple], spec: ShardSpec):
    """(sentence id, (layers, T, 2P) or (T, 2P) array in the storage dtype) per sentence, AllenNLP's layout."""
    sources = {id(b): spec.sources(b.vectors, b.layers)[1] for b, _ in sentences}
    for batch, i in sentences:
        a, e = int(batch.offsets[i]), int(batch.offsets[i + 1])
        src = sources[id(batch)]
        yield batch.items[i].id, np.ascontiguousarray(src[..., a:e, :], dtype=spec.dtype)


class Staging:
    """A run's staging folder (<out>/_staging/<run key>/) as its workers write it, through a Sink fenced by
    `fence` (output.lease.Fence: a run that lost the output's lease writes nothing more). Picklable: it travels
    to the workers inside the DoFns, which write through it."""

    def __init__(self, url: str, storage_options: dict | None = None, fence: Callable[[], None] | None = None):
        self.url, self.storage_options, self.fence = url, storage_options, fence
        self.sink, self.root = Sink.at(url, storage_options, fence)

    def __reduce__(self):
        return Staging, (self.url, self.storage_options, self.fence)

    def shard(self, sentences: list[tuple], spec: ShardSpec) -> ShardInfo:
        """Write one shard of (EmbeddedBatch, sentence index) pairs, sorted by sentence id (uuid names, one file
        per format, and its key index with spec.key_prefix), then its commit record (committed/<name>.json: the run
        key, file names, counts, sentence ids, digests, and the kernel paths its embedded sentences were computed
        on: `kernel_paths`, [] when all were reused, left out when a batch did not say)."""
        sentences = sorted(sentences, key=lambda p: p[0].items[p[1]].id)
        ids = [b.items[i].id for b, i in sentences]
        name = uuid.uuid4().hex
        files = {fmt: posixpath.join(self.root, f"{name}.{fmt}") for fmt in spec.formats}
        columns = shard_columns(sentences, spec) if {"parquet", "arrow"} & set(spec.formats) else None
        if "parquet" in files:
            with self.sink.open(files["parquet"]) as f:
                write_parquet(build_table(columns, spec.layout, list(spec.columns)), f, spec.row_group_bytes,
                              spec.vector_compression)
        if "arrow" in files:
            with self.sink.open(files["arrow"]) as f:
                write_arrow(arrow_table(columns, list(spec.columns)), f)
        if "hdf5" in files:
            with self.sink.open(files["hdf5"]) as f:
                f.write(hdf5_bytes(hdf5_sentences(sentences, spec)))
        if spec.key_prefix:
            files[KEYS] = posixpath.join(self.root, f"{name}.{KEYS}")      # keys/part-*.parquet once final
            with self.sink.open(files[KEYS]) as f:
                write_key_index(ids, [b.items[i].key or sentence_key(spec.key_prefix, b.items[i].tokens)
                                      for b, i in sentences], f)
        lengths = np.fromiter((b.tokens(i) for b, i in sentences), dtype=np.int64, count=len(sentences))
        copies = sum(i >= len(b.items) - b.copies for b, i in sentences)      # written from another's vectors
        reused = {}                                                # read from a --reuse source, by source
        for b, _ in sentences:
            if b.source is not None:
                reused[b.source] = reused.get(b.source, 0) + 1
        kernels = {b.kernel for b, _ in sentences if b.source is None}      # what embedded them (None: not recorded)
        extra = {"run": posixpath.basename(self.root.rstrip("/")),      # its staging folder's run key
                 **({"deduplicated": copies} if copies else {}), **({"reused": reused} if reused else {}),
                 "digests": {fmt: self.sink.written[path] for fmt, path in files.items()},
                 **({} if None in kernels else {"kernel_paths": [json.loads(k) for k in sorted(kernels)]})}
        info = ShardInfo(files, len(sentences), int(lengths.sum()), ids[0], extra)
        histogram = dict(zip(*(a.tolist() for a in np.unique(lengths, return_counts=True))))
        self.sink.put(self._at(RECORDS, name + ".json"), json.dumps(info.record(ids, histogram)).encode())
        return info

    def dead_letters(self, letters: list[layout.DeadLetter]) -> str:
        """Write dead letters as one staged JSONL file (dead/<uuid>.jsonl, whole or not at all); returns its path.
        A retried bundle stages its letters again: Finalize drops the duplicates (output/finalize.py)."""
        path = self._at(DEAD, uuid.uuid4().hex + ".jsonl")
        self.sink.put(path, "".join(d.to_json() + "\n" for d in letters).encode("utf-8"))
        return path

    def stats(self, stats: dict) -> None:
        """Stage a bundle's run statistics (stats/<uuid>.json, output/stats.py) for the run report."""
        self.sink.put(self._at(STATS, uuid.uuid4().hex + ".json"), json.dumps(stats).encode())

    def docs(self, rows: list[list[str]]) -> None:
        """Stage a bundle's [doc_id, doc_hash, change] rows (docs/<uuid>.jsonl, --iceberg-mode upsert); a retried
        bundle stages them again, with the same content."""
        self.sink.put(self._at(DOCS, uuid.uuid4().hex + ".jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())

    def counts(self, url: str, counts: dict, part: tuple[int, int] | None = None) -> None:
        """Stage the record counts of input file `url`, or of its part (k, of n parts) when it is read in parts
        (counts/<hash>[-k].json: one name per file or part, so a retried read rewrites the same object with the
        same content)."""
        record = {"url": url, **counts, **({"part": list(part)} if part else {})}
        self.sink.put(self._at(counts_name(url, part[0] if part else None)), json.dumps(record).encode())

    def _at(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)
