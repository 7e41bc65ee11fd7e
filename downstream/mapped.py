"""Training input at memory speed: the Arrow shards of `--format arrow` outputs, memory-mapped. No Beam import.

    from downstream.mapped import MappedDataset, BucketBatchSampler

    ds = MappedDataset(["out/part1", "out/part2"], layers=["layer_2"])   # index only: ids, offsets, lengths
    ds[7], ds.by_id("doc-3#0")                      # records as ElmoDataset's, built from memory-mapped views
    for b in ds.stream(batch_tokens=2048): ...      # file order at page-cache speed: b["vectors"] (N, D_k) per layer
    sampler = BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0, rank=r, world_size=w)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=unbatched, num_workers=2, pin_memory=True)
    for batch in loader: ...                        # layers (B, L, T, D), mask, lengths, ids (collate's keys)
    sampler.set_epoch(e, start_batch=k)             # the order of epoch e, resumed after k batches

Memory: the index, per sentence an int64 token offset, an int32 length and the arrays of ids (views of the
mapped files); vectors are never loaded whole: a batch copies its sentences' rows out of the mapped shards
(page cache) into one padded tensor; stream() reads consecutive sentences' rows with one pread per layer
into a reused buffer (the system call `cat` uses). Id lookup: a sorted array of 64-bit hashes of the ids
(16 bytes a sentence, built on the first lookup), a hit checked against the stored id. Shards of an fsspec URL (s3://...) are copied whole into `cache_dir`
on first use (the next shard is fetched in the background: read-ahead) and mapped from there.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import posixpath
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from downstream.readers import ElmoOutput, _attach, _open
from fsio import is_local_fs

_META = ("id", "doc_id", "sentence_index")

try:
    from torch.utils.data import Dataset as _TorchDataset
    from torch.utils.data import Sampler as _TorchSampler
except ImportError:  # pragma: no cover
    _TorchDataset = _TorchSampler = object  # type: ignore[assignment,misc]


def open_arrow_shard(path: str, fields: Sequence[str] | None = None) -> pa.RecordBatch:
    """The record batch of a local Arrow shard, memory-mapped (zero-copy); `fields` selects columns."""
    source = pa.memory_map(path, "r")
    reader = pa.ipc.open_file(source)
    if fields is not None:
        names = reader.schema.names
        reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(
            included_fields=[names.index(f) for f in fields]))
    if reader.num_record_batches == 0:
        return pa.RecordBatch.from_pylist([], schema=reader.schema)
    return reader.get_batch(0)


def flat_vectors(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """(N, D) view of a fixed_size_list<float, D> column, in its stored dtype, without a copy."""
    col = batch.column(name)
    d = col.type.list_size
    values = col.values.slice(col.offset * d, len(col) * d)
    return values.to_numpy(zero_copy_only=True).reshape(-1, d)


def vector_offsets(path: str, names: Sequence[str]) -> list[tuple[int, int]]:
    """(file offset of row 0, bytes per row) of each named fixed_size_list column of a local Arrow shard: the
    address of the column's values buffer in the memory map minus the map's base address."""
    source = pa.memory_map(path, "r")
    base = source.read_buffer(1).address if source.size() else 0
    reader = pa.ipc.open_file(source)
    if reader.num_record_batches == 0:
        return [(0, 0) for _ in names]
    batch, out = reader.get_batch(0), []
    for name in names:
        col = batch.column(name)
        values, row = col.values, col.type.list_size * col.values.type.byte_width
        out.append((values.buffers()[1].address - base + (values.offset + col.offset * col.type.list_size)
                    * values.type.byte_width, row))
    return out


def _id_hash(sentence_id: bytes) -> int:
    """64-bit hash of an id's UTF-8 bytes (the id lookup's key)."""
    return int.from_bytes(hashlib.blake2b(sentence_id, digest_size=8).digest(), "little")


def _string_buffers(array: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(offsets (n+1,) int32, data) of a string array: item i is data[offsets[i]:offsets[i+1]], no copy."""
    _, offsets, data = array.buffers()
    offs = np.frombuffer(offsets, np.int32)[array.offset: array.offset + len(array) + 1] if len(array) else \
        np.zeros(1, np.int32)
    return offs, memoryview(data).cast("B") if data is not None else memoryview(b"")


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset` (preadv, repeated over short reads)."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise EOFError(f"file ends before byte {offset + len(view)}")
        view, offset = view[n:], offset + n


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


class MappedDataset(_TorchDataset):
    """Map-style dataset over the Arrow shards of one or more `--format arrow` outputs (several partitions
    read as one: positions run output after output, shard after shard, sentences sorted by id in a shard).

    layers: layer names to read (default all); labels / label_key: as ElmoDataset (unlabelled sentences
    are left out, `unlabelled` counts them); tokens: include each record's tokens (a few µs each);
    dtype: of the batches' `layers` (default: float32, as ElmoDataset; None keeps the stored dtype, so
    float16 outputs stream at half the bytes); cache_dir: where shards of remote URLs are copied.

    ds[i]: a record as ElmoDataset's (id, doc_id, sentence_index, tokens, layers (L, T, dim) float32,
    layer 0 duplicated to [x, x]); ds.views(i): the stored (T, D_k) arrays, no copy; ds.batch(positions):
    a padded batch (the keys of readers.collate) copied in one pass, also what DataLoader's batched fetch
    (__getitems__) returns; ds.stream(batch_tokens): every sentence in file order at page-cache speed.
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", layers: Sequence[str] | None = None,
                 labels: Mapping[str, Any] | None = None, label_key: str = "label", tokens: bool = True,
                 dtype: str | None = "float32", storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | None = None, transform=None):
        if isinstance(sources, (str, ElmoOutput)):
            sources = [sources]
        self.outputs = [_open(s, storage_options) for s in sources]
        for out in self.outputs:
            if "arrow" not in out.formats:
                raise ValueError(f"{out.path}: no arrow shards (formats: {out.formats}); write it with --format "
                                 f"...,arrow")
        first = self.outputs[0]
        self.layers = list(layers) if layers else list(first.layer_names)
        for out in self.outputs:
            out._check("arrow", self.layers)
            if out.dim != first.dim or [out.layer_dims[n] for n in self.layers] != [first.layer_dims[n] for n in self.layers]:
                raise ValueError(f"{out.path}: layer widths differ from {first.path}'s")
        self.dim, self.widths = first.dim, [first.layer_dims[n] for n in self.layers]
        self.label_key, self.with_tokens, self.transform = label_key, tokens, transform
        self.dtype = np.dtype(dtype) if dtype else None
        self.cache_dir = cache_dir
        self.units = [(k, i) for k, out in enumerate(self.outputs) for i in range(len(out.shards))]
        self._maps: dict[int, pa.RecordBatch] = {}
        self._views: dict[int, list[np.ndarray]] = {}
        self._pid = os.getpid()
        self._fetching: dict[int, threading.Thread] = {}
        self._build_index(labels)

    # -- the index
    def _build_index(self, labels) -> None:
        ids, doc_ids, sidx, starts, lengths, unit_first = [], [], [], [], [], [0]
        for u in range(len(self.units)):
            b = self._open(u, _META)
            sid, offsets, docs, indices = sentence_index(b)
            ids.append(sid)
            doc_ids.append(docs)
            sidx.append(indices)
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets).astype(np.int32))
            unit_first.append(unit_first[-1] + len(sid))
        self._ids, self._doc_ids, self._sentence_indices = ids, doc_ids, sidx
        self._unit_first = np.asarray(unit_first, dtype=np.int64)       # (U+1,) first position of each unit
        self._firsts = unit_first                                        # the same, a list (bisect)
        self._starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        self.unlabelled = 0
        self._keep = None                                                 # positions of labelled sentences
        self._labels: list | None = None
        if labels is not None:
            keep, values = [], []
            for p in range(len(all_lengths)):
                r = _attach(self._meta(p), labels, self.label_key)
                if r is None:
                    self.unlabelled += 1
                else:
                    keep.append(p)
                    values.append(r[self.label_key])
            self._keep, self._labels = np.asarray(keep, dtype=np.int64), values
        self._all_lengths = all_lengths
        self.lengths = all_lengths if self._keep is None else all_lengths[self._keep]   # (len(self),) tokens
        self._id_table: tuple[np.ndarray, np.ndarray] | None = None     # built by the first id lookup
        self._id_buffers: list[tuple[np.ndarray, memoryview]] | None = None

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype of the stored vectors (float16 or float32: the output's --dtype)."""
        return np.dtype(self.outputs[0].manifest.get("dtype", "float32"))

    def index_bytes(self) -> int:
        """Bytes of the in-memory index (offsets, lengths, doc ids, labels kept, the id hash table once built;
        ids are views of the mapped files)."""
        n = self._starts.nbytes + self._all_lengths.nbytes + self._unit_first.nbytes + \
            sum(a.nbytes for a in self._sentence_indices) + sum(a.nbytes for a in self._doc_ids) + \
            (sum(a.nbytes for a in self._id_table) if self._id_table is not None else 0)
        return n + (self._keep.nbytes if self._keep is not None else 0)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def _position(self, i: int) -> int:
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"position {i} out of range ({n} sentences)")
        i = i % n
        return int(self._keep[i]) if self._keep is not None else i

    def _unit(self, p: int) -> tuple[int, int]:
        """(unit, sentence within it) of global position p."""
        u = bisect.bisect_right(self._firsts, p) - 1
        return u, p - self._firsts[u]

    def _meta(self, p: int) -> dict:
        u, s = self._unit(p)
        return {"id": self._ids[u][s].as_py(), "doc_id": self._doc_ids[u][s].as_py(),
                "sentence_index": int(self._sentence_indices[u][s])}

    def position(self, sentence_id: str) -> int:
        """The dataset position of a sentence id; KeyError if absent. A binary search in the sorted 64-bit
        hashes of all ids (built on the first call: 16 bytes a sentence), each hit checked against the id."""
        key = sentence_id.encode()
        hashes, positions = self._ids_by_hash()
        h = np.uint64(_id_hash(key))
        k = int(hashes.searchsorted(h))
        while k < len(hashes) and hashes[k] == h:
            p = int(positions[k])
            u, s = self._unit(p)
            offs, data = self._id_buffers[u]
            if data[offs[s]: offs[s + 1]] == key:
                return self._kept_position(p, sentence_id)
            k += 1
        raise KeyError(sentence_id)

    def _kept_position(self, p: int, sentence_id: str) -> int:
        """Dataset position of global position p (its index among the labelled ones when labels are given)."""
        if self._keep is None:
            return p
        k = int(np.searchsorted(self._keep, p))
        if k < len(self._keep) and self._keep[k] == p:
            return k
        raise KeyError(sentence_id)

    def _ids_by_hash(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted id hashes (S,) uint64, their global positions (S,) int64); the ids' string buffers too."""
        if self._id_buffers is None:
            self._id_buffers = [_string_buffers(a) for a in self._ids]
        if self._id_table is None:
            hashes = np.fromiter((_id_hash(data[offs[s]: offs[s + 1]]) for offs, data in self._id_buffers
                                  for s in range(len(offs) - 1)), dtype=np.uint64, count=len(self._all_lengths))
            order = np.argsort(hashes, kind="stable")
            self._id_table = (hashes[order], order.astype(np.int64))
        return self._id_table

    # -- the mapped shards (opened lazily in each process: DataLoader workers map the files themselves)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"], state["_views"], state["_fetching"], state["_id_buffers"] = {}, {}, {}, None
        return state

    def _open(self, u: int, fields: Sequence[str] | None = None) -> pa.RecordBatch:
        if fields is not None:
            return open_arrow_shard(self._local(u), fields)
        if self._pid != os.getpid():
            self._maps, self._views, self._fetching, self._pid = {}, {}, {}, os.getpid()
        b = self._maps.get(u)
        if b is None:
            b = self._maps[u] = open_arrow_shard(self._local(u))
            if not is_local_fs(self.outputs[self.units[u][0]].fs) and u + 1 < len(self.units):
                self._prefetch(u + 1)
        return b

    def _remote(self, u: int) -> tuple[Any, str, str]:
        """(fs, path, local cache path) of unit u."""
        k, i = self.units[u]
        out = self.outputs[k]
        path = out.shard_path(i, "arrow")
        root = self.cache_dir or os.path.join(tempfile.gettempdir(), "elmo-mapped")
        key = hashlib.sha256(f"{out.path}|{out.manifest.get('run', {}).get('key')}".encode()).hexdigest()[:16]
        return out.fs, path, os.path.join(root, key, posixpath.basename(path))

    def _local(self, u: int) -> str:
        k, i = self.units[u]
        out = self.outputs[k]
        if is_local_fs(out.fs):
            return out.shard_path(i, "arrow")
        fetching = self._fetching.pop(u, None)
        if fetching is not None:
            fetching.join()
        fs, path, local = self._remote(u)
        if not (os.path.exists(local) and os.path.getsize(local) == fs.size(path)):
            _download(fs, path, local)
        return local

    def _prefetch(self, u: int) -> None:
        fs, path, local = self._remote(u)
        if u in self._fetching or os.path.exists(local):
            return
        t = threading.Thread(target=_download, args=(fs, path, local), daemon=True)
        t.start()
        self._fetching[u] = t

    # -- records
    def views(self, i: int) -> list[np.ndarray]:
        """The stored (T, D_k) arrays of record i, one per selected layer: views of the mapped file."""
        p = self._position(i)
        a, n = int(self._starts[p]), int(self._all_lengths[p])
        return [v[a: a + n] for v in self._layer_views(self._unit(p)[0])]

    def _layer_views(self, u: int) -> list[np.ndarray]:
        """(N, D_k) views of unit u's selected layers (kept beside the mapped batch)."""
        self._open(u)
        views = self._views.get(u)
        if views is None:
            views = self._views[u] = [flat_vectors(self._maps[u], name) for name in self.layers]
        return views

    def __getitem__(self, i: int) -> dict:
        p = self._position(i)
        r = self._meta(p)
        u, s = self._unit(p)
        if self.with_tokens:
            a, n = int(self._starts[p]), int(self._all_lengths[p])
            r["tokens"] = self._open(u).column("token").slice(a, n).to_pylist()
        if self._labels is not None:
            r[self.label_key] = self._labels[i % len(self)]
        r["layers"] = self.outputs[0].stack(self.views(i))
        return self.transform(r) if self.transform else r

    def by_id(self, sentence_id: str) -> dict:
        return self[self.position(sentence_id)]

    def batch(self, positions: Sequence[int], pin_memory: bool = False) -> dict:
        """A padded batch of the records at `positions`: layers (B, L, T, dim) in `dtype` (layer 0 duplicated,
        zero past each length), mask (B, T) bool, lengths (B,) int64, ids, doc_ids, tokens (lists; tokens
        None unless tokens=True), and label / tags as readers.collate makes them."""
        import torch
        pos = [self._position(int(i)) for i in positions]
        lengths = self._all_lengths[pos] if pos else np.zeros(0, np.int32)
        B, T, L = len(pos), int(lengths.max(initial=0)), len(self.layers)
        dtype = self.dtype or self.stored_dtype
        pin = pin_memory and torch.cuda.is_available()
        stored = torch.empty((B, L, T, self.dim), dtype=getattr(torch, self.stored_dtype.name),
                             pin_memory=pin and dtype == self.stored_dtype)
        _fill(stored.numpy(), self, pos, lengths)
        out = stored if dtype == self.stored_dtype else stored.to(getattr(torch, dtype.name))   # one pass
        if pin and not out.is_pinned():
            out = out.pin_memory()
        mask = torch.from_numpy(np.arange(T)[None, :] < lengths[:, None])
        metas = [self._meta(p) for p in pos]
        batch = {"layers": out, "mask": mask, "lengths": torch.from_numpy(lengths.astype(np.int64)),
                 "ids": [m["id"] for m in metas], "doc_ids": [m["doc_id"] for m in metas],
                 "tokens": [self._tokens(p) for p in pos] if self.with_tokens else [None] * B}
        if self._labels is not None:
            batch[self.label_key] = _label_batch([self._labels[int(i) % len(self)] for i in positions], T, self.label_key)
        return batch

    __getitems__ = batch

    def _tokens(self, p: int) -> list[str]:
        u, _ = self._unit(p)
        return self._open(u).column("token").slice(int(self._starts[p]), int(self._all_lengths[p])).to_pylist()

    def batches(self, sampler: "BucketBatchSampler | None" = None, batch_size: int = 32) -> Iterator[dict]:
        """Padded batches in the sampler's order (default: every sentence in order, `batch_size` at a time)."""
        plan = sampler if sampler is not None else (range(s, min(s + batch_size, len(self)))
                                                    for s in range(0, len(self), batch_size))
        for positions in plan:
            yield self.batch(list(positions))

    def stream(self, batch_tokens: int = 2048, layers: Sequence[str] | None = None, padded: bool = False,
               pin_memory: bool = False) -> Iterator[dict]:
        """Every sentence of the dataset in file order (output, shard, id), in batches of consecutive sentences
        spanning at most `batch_tokens` rows (a longer sentence alone). Each layer's rows of a batch are one
        byte range of the shard: one pread per layer straight into a reused buffer (pinned with pin_memory
        when CUDA is there), no per-sentence work.

        Yields dicts: vectors, one (N, D_k) tensor per layer in the stored dtype (views of the reused
        buffer: valid until the next batch, clone to keep); starts, lengths (B,) int64: sentence b is rows
        starts[b]:starts[b] + lengths[b] of each (a labelled dataset skips the unlabelled rows between);
        ids, doc_ids (lists), the label as batch() gives it; padded=True adds layers (B, L, T, dim) in
        `dtype` (layer 0 duplicated, zero past each length) and mask (B, T) bool.
        layers: a subset of the dataset's layers (default all)."""
        import torch
        names = list(layers) if layers else self.layers
        missing = [n for n in names if n not in self.layers]
        if missing:
            raise ValueError(f"layers {missing} are not among the dataset's {self.layers}")
        plan = self._stream_plan(max(1, batch_tokens))
        rows = max((int(self._starts[q[-1]] + self._all_lengths[q[-1]] - self._starts[q[0]]) for _, q, _ in plan),
                   default=0)
        stored = getattr(torch, self.stored_dtype.name)
        width = [self.outputs[0].layer_dims[n] * self.stored_dtype.itemsize for n in names]
        region = [-(-rows * w // 64) * 64 for w in width]                   # each layer's share, 64-byte aligned
        buf = torch.empty(sum(region), dtype=torch.uint8, pin_memory=pin_memory and torch.cuda.is_available())
        view, base = memoryview(buf.numpy()), np.cumsum([0] + region[:-1]).tolist()
        fd, fd_unit = -1, -1
        try:
            for u, pos, kept in plan:
                if u != fd_unit:
                    if fd >= 0:
                        os.close(fd)
                    path = self._local(u)
                    if not is_local_fs(self.outputs[self.units[u][0]].fs) and u + 1 < len(self.units):
                        self._prefetch(u + 1)
                    offsets, fd, fd_unit = vector_offsets(path, names), os.open(path, os.O_RDONLY), u
                first = int(self._starts[pos[0]])
                n = int(self._starts[pos[-1]] + self._all_lengths[pos[-1]]) - first
                vectors = []
                for (off, row), at, w in zip(offsets, base, width):
                    _pread_into(fd, view[at: at + n * row], off + first * row)
                    vectors.append(buf[at: at + n * row].view(stored).view(n, row // self.stored_dtype.itemsize))
                yield self._stream_batch(vectors, pos, kept, first, padded)
        finally:
            if fd >= 0:
                os.close(fd)

    def _stream_plan(self, batch_tokens: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(unit, global positions (B,), dataset positions (B,)) of each stream batch: consecutive positions
        of one unit whose rows span at most batch_tokens (or one sentence)."""
        kept = self._keep if self._keep is not None else np.arange(len(self._all_lengths), dtype=np.int64)
        plan = []
        for u in range(len(self.units)):
            lo, hi = np.searchsorted(kept, self._firsts[u: u + 2])
            j = lo
            while j < hi:
                first, k = int(self._starts[kept[j]]), j + 1
                while k < hi and int(self._starts[kept[k]] + self._all_lengths[kept[k]]) - first <= batch_tokens:
                    k += 1
                plan.append((u, kept[j:k], np.arange(j, k)))
                j = k
        return plan

    def _stream_batch(self, vectors: list, pos: np.ndarray, kept: np.ndarray, first: int, padded: bool) -> dict:
        import torch
        u, s = self._unit(int(pos[0]))
        lengths = torch.from_numpy(self._all_lengths[pos].astype(np.int64))
        starts = torch.from_numpy(self._starts[pos] - first)
        rel = slice(s, s + len(pos)) if self._keep is None else (pos - self._firsts[u])
        ids, docs = self._ids[u], self._doc_ids[u]
        pick = (lambda a: a.slice(rel.start, len(pos))) if isinstance(rel, slice) else (lambda a: a.take(pa.array(rel)))
        batch = {"vectors": vectors, "starts": starts, "lengths": lengths,
                 "ids": pick(ids).to_pylist(), "doc_ids": pick(docs).to_pylist()}
        T = int(lengths.max()) if len(lengths) else 0
        if self._labels is not None:
            batch[self.label_key] = _label_batch([self._labels[int(i)] for i in kept], T, self.label_key)
        if padded:
            batch["layers"], batch["mask"] = self._padded(vectors, starts, lengths, T)
        return batch

    def _padded(self, vectors: list, starts, lengths, T: int):
        """(layers (B, L, T, dim) in `dtype`, mask (B, T)) of flat (N, D_k) vectors: one gather per layer."""
        import torch
        mask = torch.arange(T)[None, :] < lengths[:, None]
        rows = (starts[:, None] + torch.arange(T)[None, :]).clamp_(max=max(0, len(vectors[0]) - 1))
        dtype = getattr(torch, (self.dtype or self.stored_dtype).name)
        out = torch.empty((len(lengths), len(vectors), T, self.dim), dtype=dtype)
        for k, v in enumerate(vectors):
            g = v[rows].to(dtype).masked_fill_(~mask[..., None], 0)
            out[:, k, :, : v.shape[1]] = g
            if v.shape[1] != self.dim:
                out[:, k, :, v.shape[1]:] = g
        return out, mask


def _fill(out: np.ndarray, ds: MappedDataset, pos: list[int], lengths: np.ndarray) -> None:
    """Copy the rows of the sentences at global positions `pos` into out (B, L, T, dim), the stored dtype:
    one copy per sentence and layer straight from the mapped shard (a P-wide layer 0 into both halves),
    zeros past each length."""
    dim, views = ds.dim, {}
    for b, (p, n) in enumerate(zip(pos, lengths)):
        u, _ = ds._unit(p)
        if u not in views:
            views[u] = ds._layer_views(u)
        a, n = int(ds._starts[p]), int(n)
        for k, v in enumerate(views[u]):
            src = v[a: a + n]
            d = src.shape[1]
            out[b, k, :n, :d] = src
            if d != dim:
                out[b, k, :n, d:] = src
        out[b, :, n:] = 0


def _label_batch(values: list, T: int, key: str):
    """Labels as readers.collate batches them: "label" (B,) int64 when all ints; "tags" (B, T) int64 padded with
    -100 when int lists; other values stay a list."""
    import torch
    if key == "tags" and all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in values):
        tags = torch.full((len(values), T), -100, dtype=torch.int64)
        for b, v in enumerate(values):
            tags[b, : len(v)] = torch.tensor(v, dtype=torch.int64)
        return tags
    if key != "tags" and all(isinstance(v, int) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    return values


def unbatched(batch: dict) -> dict:
    """collate_fn for DataLoader(MappedDataset, batch_sampler=...): the dataset's __getitems__ already made
    the batch."""
    return batch


def _download(fs, path: str, local: str) -> None:
    """Copy fs:path to the local file `local`, whole or not at all (a unique temporary name, then a rename)."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        fs.get_file(path, tmp)
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class BucketBatchSampler(_TorchSampler):
    """Batches of dataset positions, deterministic per (seed, epoch), split across ranks, resumable.

    lengths: tokens per sentence (MappedDataset.lengths). Positions (in order, or with shuffle=True a
    permutation of (seed, epoch)) are cut into buckets of `bucket_batches` batches, each bucket sorted by
    length before it is cut into batches (little padding); with shuffle the batches are then permuted.
    bucket_batches=0: no sorting, batches of consecutive positions.
    max_tokens: cap a batch at this many padded tokens (B x longest) instead of a fixed count.
    Ranks (DistributedSampler's splitting): rank r takes batches r, r + world_size, ...; the list is
    wrapped so every rank gets the same count. set_epoch(e, start_batch=k): epoch e's order, resumed after
    the first k batches of this rank. Under DataLoader workers each batch is fetched once (the loader
    deals the batches out).
    """

    def __init__(self, lengths: np.ndarray, batch_size: int = 32, shuffle: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1, bucket_batches: int = 100, max_tokens: int | None = None,
                 drop_last: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.shuffle, self.seed = max(1, batch_size), shuffle, seed
        self.rank, self.world_size, self.bucket_batches = rank, world_size, max(0, bucket_batches)
        self.max_tokens, self.drop_last = max_tokens, drop_last
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def _cut(self, order: np.ndarray) -> list[np.ndarray]:
        if self.max_tokens is None:
            return [order[s: s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        out, start, longest = [], 0, 0
        for j, p in enumerate(order):
            longest = max(longest, int(self.lengths[p]))
            if j > start and (longest * (j - start + 1) > self.max_tokens or j - start >= self.batch_size):
                out.append(order[start:j])
                start, longest = j, int(self.lengths[p])
        if start < len(order):
            out.append(order[start:])
        return out

    def all_batches(self) -> list[np.ndarray]:
        """Every batch of this epoch, all ranks, in order."""
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if not self.bucket_batches:
            batches = self._cut(order)
        else:
            size, batches = self.batch_size * self.bucket_batches, []
            for s in range(0, n, size):
                chunk = order[s: s + size]
                batches += self._cut(chunk[np.argsort(self.lengths[chunk], kind="stable")])
        return [batches[j] for j in rng.permutation(len(batches))] if self.shuffle else batches

    def rank_batches(self) -> list[np.ndarray]:
        """This rank's batches of this epoch (before start_batch is applied)."""
        batches = self.all_batches()
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.world_size]
        elif batches and len(batches) % self.world_size:
            pad = self.world_size - len(batches) % self.world_size
            batches = batches + [batches[j % len(batches)] for j in range(pad)]
        return batches[self.rank:: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        for b in self.rank_batches()[self.start_batch:]:
            yield b.tolist()

    def __len__(self) -> int:
        return max(0, len(self.rank_batches()) - self.start_batch)
