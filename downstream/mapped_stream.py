"""MappedDataset.stream() (downstream/mapped.py): every sentence in file order, in batches of consecutive sentences
read with one pread per layer into reused buffers (downstream/stream_rows.py), padded on request. No Beam import.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.batching import label_batch
from elmo_pipeline.downstream.stream_rows import RowBuffer, halves, read_ahead, read_rows, stream_plan

STREAM_BYTES = 8 << 20                      # stored bytes a stream batch spans by default
PADDED_BYTES = 6 << 20                      # a padded stream batch's bytes (B x T x L x dim) by default: CPU cache


def stream_batches(ds, batch_tokens: int | None = None, layers: Sequence[str] | None = None, padded: bool = False,
                   pin_memory: bool = False, ahead: int = 0) -> Iterator[dict]:
    """MappedDataset.stream(batch_tokens, layers, padded, pin_memory, ahead) of the dataset `ds` (see there)."""
    names = list(layers) if layers else ds.layers
    missing = [n for n in names if n not in ds.layers]
    if missing:
        raise ValueError(f"layers {missing} are not among the dataset's {ds.layers}")
    read = ds.index.keep if ds.index.keep is not None else np.arange(len(ds.index.all_lengths), dtype=np.int64)
    padded_tokens = 0                                   # by default a padded batch's bytes cap it too
    if batch_tokens is None:
        batch_tokens = STREAM_BYTES // (sum(ds.outputs[0].layer_dims[n] for n in names) * ds.stored_dtype.itemsize)
        if padded:
            padded_tokens = max(1, PADDED_BYTES // (len(names) * ds.dim * (ds.dtype or ds.stored_dtype).itemsize))
    plan = stream_plan(read, ds.index.firsts, ds.index.starts, ds.index.all_lengths, max(1, batch_tokens), padded_tokens)
    rows = max((int(ds.index.starts[q[-1]] + ds.index.all_lengths[q[-1]] - ds.index.starts[q[0]]) for _, q, _ in plan),
               default=0)
    width = [ds.outputs[0].layer_dims[n] * ds.stored_dtype.itemsize for n in names]
    slots = [(RowBuffer(rows, width, ds.stored_dtype, pin_memory),
              ds.pool.new(pin_memory) if padded else None) for _ in range(ahead + 2 if ahead > 0 else 1)]
    return read_ahead(_batches(ds, plan, names, slots), ahead)


def _batches(ds, plan: list, names: list[str], slots: list) -> Iterator[dict]:
    """stream()'s batches, each read into the next of `slots` ((RowBuffer, Batcher or None), in turn)."""
    held: dict[int, int] = {}                          # the shard being read: {unit: descriptor} (ShardFiles)
    pick = [ds.layers.index(n) for n in names]
    try:
        for j, (u, pos, kept) in enumerate(plan):
            buf, batcher = slots[j % len(slots)]
            if u not in held:
                ds.files.release(held)
                held = {}                               # nothing held should the next open fail
                held = ds.files.acquire([u], ds.local_path)
                ds.prefetch_after(u)
                found, rows = ds.files.offsets(u), ds.files.rows
                offsets = [(int(found[k]), int(rows[k])) for k in pick]
                fd = held[u]
            first = int(ds.index.starts[pos[0]])
            n = int(ds.index.starts[pos[-1]] + ds.index.all_lengths[pos[-1]]) - first
            into = batcher.destinations(n, [w // buf.dtype.itemsize for w in buf.widths], buf.dtype) \
                if batcher else None
            vectors = buf.views(offsets, n, into)
            helper = ds.pool.helper(n * sum(r for _, r in offsets))
            try:
                batch = _batch(ds, vectors, pos, kept, first, batcher,
                                           partial(read_rows, fd, offsets, first, vectors), helper)
            except EOFError as e:
                raise ds.files.shorter([u], e, ds.local_path) from None
            yield batch
    finally:
        ds.files.release(held)


def _batch(ds, vectors: list, pos: np.ndarray, kept: np.ndarray, first: int, batcher, read, helper) -> dict:
    """The stream batch of positions pos: read(a, b) fills rows a:b of vectors (the helper thread the second
    half), padded by batcher when given."""
    import torch
    u, s = ds.index.unit(int(pos[0]))
    lengths = torch.from_numpy(ds.index.all_lengths[pos].astype(np.int64))
    starts = torch.from_numpy(ds.index.starts[pos] - first)
    rel = slice(s, s + len(pos)) if ds.index.keep is None else (pos - ds.index.firsts[u])
    ids, docs = ds.index.ids[u], ds.index.doc_ids[u]
    pick = (lambda a: a.slice(rel.start, len(pos))) if isinstance(rel, slice) else (lambda a: a.take(pa.array(rel)))
    batch = {"vectors": vectors, "starts": starts, "lengths": lengths,
             "ids": pick(ids).to_pylist(), "doc_ids": pick(docs).to_pylist()}
    T = int(lengths.max()) if len(lengths) else 0
    if ds.index.labels is not None:
        batch[ds.label_key] = label_batch([ds.index.labels[int(i)] for i in kept], T, ds.label_key)
    if batcher is not None:
        batch["layers"], batch["mask"] = batcher.from_rows(vectors, starts, lengths, read, helper)
    else:
        n = int(vectors[0].shape[0]) if vectors else 0
        halves(read, n, helper)
    return batch
