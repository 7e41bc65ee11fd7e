"""Arrow IPC shards of `--format arrow` outputs (formats/arrow.py): a row per token, sorted by sentence id.
Local shards are memory-mapped and their columns viewed without a copy. No Beam import."""
from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.shard_checks import DamagedOutput, field_names
from elmo_pipeline.formats import arrow as arrow_format
from elmo_pipeline.fsio import is_local_fs


def open_arrow_shard(path: str, fields: Sequence[str] | None = None) -> pa.RecordBatch:
    """The record batch of a local Arrow shard, memory-mapped (zero-copy); `fields` selects columns.
    DamagedOutput when the file is no Arrow IPC file."""
    return map_arrow_shard(path, fields)[0]


def map_arrow_shard(path: str, fields: Sequence[str] | None = None,
                    read_around: bool = True) -> tuple[pa.RecordBatch, int, int]:
    """(record batch, address of the map's first byte, file size) of a local Arrow shard, memory-mapped, its IPC
    metadata read with the kernel's read-around off (set_read_around), so that opening a shard whose pages are
    not in the page cache reads the pages it touches only; read_around=False leaves it off (an index reading the
    ids: the caller turns it back on). The file is read through one buffer viewing the whole map: pa.memory_map's
    own reads would ask the kernel to read ahead (WILLNEED) the record batch's body, up to the device's
    read-ahead size (8 MiB of vectors a shard on a virtio disk)."""
    source = pa.memory_map(path, "r")
    size = source.size()
    first = source.read_buffer(1)                   # a view that keeps the map, not the descriptor, open
    source.close()
    whole = pa.foreign_buffer(first.address, size, base=first) if size else pa.py_buffer(b"")
    set_read_around(whole.address, size, False)
    try:
        reader = pa.ipc.open_file(pa.BufferReader(whole))
        check_uncompressed(whole, path)
        names = field_names(reader.schema, path)
        if fields is not None:
            reader = pa.ipc.open_file(pa.BufferReader(whole), options=pa.ipc.IpcReadOptions(
                included_fields=[names.index(f) for f in fields]))
        batch = reader.get_batch(0) if reader.num_record_batches else \
            pa.RecordBatch.from_pylist([], schema=reader.schema)
    except (pa.ArrowException, OSError) as e:     # pyarrow's IO errors (a footer that fails verification) are OSErrors
        raise DamagedOutput(f"{path}: not a readable Arrow IPC file ({e})") from None
    if read_around:
        set_read_around(whole.address, size, True)
    return batch, whole.address, size


_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def set_read_around(base: int, size: int, on: bool) -> None:
    """Turn the kernel's read-around of a map's page faults on (MADV_NORMAL: a fault on a page not in the page
    cache reads up to the device's read-ahead size around it) or off (MADV_RANDOM: it reads that page only).
    Advice only: a kernel that refuses it changes nothing."""
    if size:
        _madvise(base, size, mmap.MADV_NORMAL if on else mmap.MADV_RANDOM)


def read_arrow_shard(fs, path: str) -> pa.RecordBatch:
    """The record batch of the shard at fs:path: memory-mapped when local, else read whole into memory."""
    if is_local_fs(fs):
        return open_arrow_shard(path)
    data = pa.py_buffer(fs.cat_file(path))       # a storage error is the storage's, not a damaged shard
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        check_uncompressed(data, path)
        field_names(reader.schema, path)
        if reader.num_record_batches == 0:
            return pa.RecordBatch.from_pylist([], schema=reader.schema)
        return reader.get_batch(0)
    except (pa.ArrowException, OSError) as e:     # pyarrow's IO errors (a footer that fails verification) are OSErrors
        raise DamagedOutput(f"{path}: not a readable Arrow IPC file ({e})") from None


def check_uncompressed(data: pa.Buffer, path: str) -> None:
    """DamagedOutput unless no batch of the Arrow IPC file `data` declares body compression, read from its footer and
    metadata (formats.arrow.check_uncompressed)."""
    try:
        arrow_format.check_uncompressed(data)
    except ValueError as e:
        raise DamagedOutput(f"{path}: {e}") from None


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
