"""Arrow IPC shards of `--format arrow` outputs (formats/arrow.py): a row per token, sorted by sentence id.
Local shards are memory-mapped and their columns viewed without a copy. No Beam import."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.shard_checks import DamagedOutput
from elmo_pipeline.fsio import is_local_fs


def open_arrow_shard(path: str, fields: Sequence[str] | None = None) -> pa.RecordBatch:
    """The record batch of a local Arrow shard, memory-mapped (zero-copy); `fields` selects columns.
    DamagedOutput when the file is no Arrow IPC file."""
    return map_arrow_shard(path, fields)[0]


def map_arrow_shard(path: str, fields: Sequence[str] | None = None) -> tuple[pa.RecordBatch, int, int]:
    """(record batch, address of the map's first byte, file size) of a local Arrow shard, memory-mapped."""
    source = pa.memory_map(path, "r")
    try:
        base = source.read_buffer(1).address if source.size() else 0
        source.seek(0)
        reader = pa.ipc.open_file(source)
        if fields is not None:
            names = reader.schema.names
            reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(
                included_fields=[names.index(f) for f in fields]))
        if reader.num_record_batches == 0:
            return pa.RecordBatch.from_pylist([], schema=reader.schema), base, source.size()
        return reader.get_batch(0), base, source.size()
    except pa.ArrowException as e:
        raise DamagedOutput(f"{path}: not a readable Arrow IPC file ({e})") from None


def read_arrow_shard(fs, path: str) -> pa.RecordBatch:
    """The record batch of the shard at fs:path: memory-mapped when local, else read whole into memory."""
    if is_local_fs(fs):
        return open_arrow_shard(path)
    try:
        reader = pa.ipc.open_file(pa.BufferReader(fs.cat_file(path)))
        if reader.num_record_batches == 0:
            return pa.RecordBatch.from_pylist([], schema=reader.schema)
        return reader.get_batch(0)
    except pa.ArrowException as e:
        raise DamagedOutput(f"{path}: not a readable Arrow IPC file ({e})") from None


def flat_vectors(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """(N, D) view of a fixed_size_list<float, D> column, in its stored dtype, without a copy."""
    col = batch.column(name)
    d = col.type.list_size
    values = col.values.slice(col.offset * d, len(col) * d)
    return values.to_numpy(zero_copy_only=True).reshape(-1, d)


def layer_offsets(batch: pa.RecordBatch, base: int, size: int, names: Sequence[str],
                  path: str) -> list[tuple[int, int]]:
    """(file offset of row 0, bytes per row) of each named fixed_size_list column of a mapped shard's batch:
    the address of the column's values buffer in the map minus the map's base address (map_arrow_shard);
    DamagedOutput when the rows reach past the file's end."""
    out = []
    for name in names:
        col = batch.column(name)
        values, row = col.values, col.type.list_size * col.values.type.byte_width
        if len(col) == 0:
            out.append((0, row))
            continue
        out.append((values.buffers()[1].address - base + (values.offset + col.offset * col.type.list_size)
                    * values.type.byte_width, row))
        if out[-1][0] < 0 or out[-1][0] + len(col) * row > size:
            raise DamagedOutput(f"{path}: column {name}'s rows lie outside the file")
    return out


def sentence_index(batch: pa.RecordBatch) -> tuple[pa.Array, np.ndarray, pa.Array, np.ndarray]:
    """(ids (S,) string, token offsets (S+1,) int64, doc ids (S,) string, sentence indices (S,) int32) of a
    shard's id/doc_id/sentence_index columns: rows are sorted by sentence, so sentence s holds the rows whose
    id code is s, found by binary search over the codes (no pass over every token)."""
    ids = batch.column("id")
    codes = ids.indices.to_numpy(zero_copy_only=False)
    offsets = np.searchsorted(codes, np.arange(len(ids.dictionary) + 1), side="left").astype(np.int64)
    starts = offsets[:-1]
    docs = batch.column("doc_id")
    doc_ids = docs.dictionary.take(pa.array(docs.indices.to_numpy(zero_copy_only=False)[starts])) if len(starts) \
        else pa.array([], pa.string())
    indices = batch.column("sentence_index").to_numpy(zero_copy_only=False)[starts].astype(np.int32)
    return ids.dictionary, offsets, doc_ids, indices
