"""Training input at memory speed: the Arrow shards of `--format arrow` outputs, memory-mapped. No Beam import.

    from elmo_pipeline.downstream.mapped import MappedDataset, unbatched
    from elmo_pipeline.downstream.sampler import BucketBatchSampler

    ds = MappedDataset(["out/part1", "out/part2"], layers=["layer_2"])   # index only: ids, offsets, lengths
    ds[7], ds.by_id("doc-3#0")                      # records as ElmoDataset's
    for b in ds.stream(): ...                       # file order at page-cache speed: b["vectors"] (N, D_k) per layer
    sampler = BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0, rank=r, world_size=w)
    for batch in ds.batches(sampler, reuse=True): ...   # layers (B, L, T, D), mask, lengths, ids (collate's keys)
    loader = DataLoader(MappedDataset(paths, reuse=True), batch_sampler=sampler, collate_fn=unbatched, num_workers=0,
                        pin_memory=True)            # the same batches, each valid until the next
    sampler.set_epoch(e, start_batch=k)             # the order of epoch e, resumed after k batches

Memory: the index, per sentence an int64 token offset, an int32 length, its id and doc id (copied from the shards: a
shard's map may be dropped); vectors are never loaded whole (a process keeps the 4,096 most recently used shards
mapped: the kernel bounds the mappings of a process): a batch copies its sentences' rows from the mapped shards (the
maps the index was built from) into one padded tensor, the caller and a helper thread half the sentences each
(`threads=2`, batches of 1 MiB or more: the first copies from a shard fault its pages in, on both cores); a record
is copied from the mapped rows too (downstream/batching.py builds every batch); stream() reads consecutive
sentences' rows with one pread per layer into a reused buffer (the system call `cat` uses). Every shard is checked
against the manifest when the index is built (downstream/shard_checks.py), its layers' file offsets and size kept
(downstream/shard_files.py: the descriptors of stream reads and of the size check before each batch, thread-safe).
Id lookup: a sorted array of 64-bit hashes of the ids (16 bytes a sentence, built on the first lookup:
downstream/id_table.py), a hit checked against the stored id. Shards of an fsspec URL (s3://...) are copied whole
into `cache_dir` on first use (the next shard is fetched in the background: read-ahead; downstream/shard_cache.py)
and mapped from there.

In parts: the index (downstream/mapped_index.py), the per-process Batchers and read helper thread
(downstream/batcher_pool.py), stream() (downstream/mapped_stream.py); this module holds the dataset API and the maps.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.arrow_shards import (flat_vectors, layer_offsets, map_arrow_shard,
                                                   sentence_index, set_read_around)
from elmo_pipeline.downstream.batcher_pool import BatcherPool
from elmo_pipeline.downstream.batching import Batcher, label_batch, stack
from elmo_pipeline.downstream.mapped_index import MappedIndex
from elmo_pipeline.downstream.output import ElmoOutput, open_outputs
from elmo_pipeline.downstream.sampler import BucketBatchSampler
from elmo_pipeline.downstream.shard_cache import ShardCache
from elmo_pipeline.downstream.shard_checks import DamagedOutput, regular
from elmo_pipeline.downstream.shard_files import ShardFiles
from elmo_pipeline.downstream.mapped_stream import stream_batches
from elmo_pipeline.downstream.stream_rows import read_ahead
from elmo_pipeline.fsio import is_local_fs

_FDS = 64                                   # shard files a process keeps open for batch reads
_MAPS = 4096                                # shards a process keeps mapped (the most recently used; every map is
                                            # one of the kernel's vm.max_map_count mappings a process, 65,530 here)

try:
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object  # type: ignore[assignment,misc]


class MappedDataset(_TorchDataset):
    """Map-style dataset over the Arrow shards of one or more `--format arrow` outputs (several partitions
    read as one: positions run output after output, shard after shard, sentences sorted by id in a shard).

    layers: layer names to read (default all); labels / label_key: as ElmoDataset (unlabelled sentences
    are left out, `unlabelled` counts them); tokens: include each record's tokens (a few µs each);
    dtype: of the batches' `layers` (default: float32, as ElmoDataset; None keeps the stored dtype, so
    float16 outputs stream at half the bytes); cache_dir: where shards of remote URLs are copied; threads: 2
    reads a batch of 1 MiB or more with a helper thread (one a process), 1 in the caller's thread only;
    reuse: DataLoader's batched fetch (__getitems__) builds into buffers kept between batches, as
    batches(reuse=True) (each batch valid until the next fetch: for a loop that consumes or moves each batch
    before the next one, num_workers=0; not under a wrapper that fetches a batch ahead without copying the
    current one (docs/downstream.md); a worker process builds batches of their own, which cross to the main
    process); packed: that fetch returns batch()'s packed form (the sentences back to back, no padding).

    ds[i]: a record as ElmoDataset's (id, doc_id, sentence_index, tokens, layers (L, T, dim) float32,
    layer 0 duplicated to [x, x]); ds.views(i): the stored (T, D_k) arrays, no copy; ds.batch(positions):
    a padded batch (the keys of readers.collate), also what DataLoader's batched fetch (__getitems__)
    returns; ds.batches(sampler, reuse=True): the sampler's batches in reused buffers; ds.stream(batch_tokens):
    every sentence in file order at page-cache speed. Outputs of different stored dtypes or widths are
    refused (ElmoDataset reads them together, as float32).
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", layers: Sequence[str] | None = None,
                 labels: Mapping[str, Any] | None = None, label_key: str = "label", tokens: bool = True,
                 dtype: str | None = "float32", storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | None = None, transform=None, threads: int = 2, reuse: bool = False,
                 packed: bool = False):
        self.outputs = open_outputs(sources, storage_options)
        for out in self.outputs:
            if "arrow" not in out.formats:
                raise ValueError(f"{out.shown}: no arrow shards (formats: {out.formats}); write it with --format "
                                 f"...,arrow")
        first = self.outputs[0]
        self.layers = list(layers) if layers else list(first.layer_names)
        for out in self.outputs:
            out.check("arrow", self.layers)
            if out.dim != first.dim or [out.layer_dims[n] for n in self.layers] != [first.layer_dims[n] for n in self.layers]:
                raise ValueError(f"{out.shown}: layer widths differ from {first.shown}'s")
            if out.dtype != first.dtype:
                raise ValueError(f"{out.shown}: stored dtype {out.dtype} differs from {first.shown}'s {first.dtype} "
                                 f"(read them as separate datasets, or with ElmoDataset, which converts to float32)")
        self.dim, self.widths = first.dim, [first.layer_dims[n] for n in self.layers]
        self.label_key, self.with_tokens, self.transform = label_key, tokens, transform
        self.dtype = np.dtype(dtype) if dtype else None
        self.cache = ShardCache(cache_dir)
        self.units = [(k, i) for k, out in enumerate(self.outputs) for i in range(len(out.shards))]
        self._maps: dict[int, tuple[pa.RecordBatch, list[np.ndarray]]] = {}     # unit -> its map, its layers' views
        self.files = ShardFiles(len(self.units), len(self.layers), _FDS)     # batch reads' descriptors
        self.threads, self.reuse, self.packed = threads, reuse, packed
        self.pool = BatcherPool(self.dim, (self.dtype or np.dtype(first.dtype)).name, threads)
        self._pid = os.getpid()
        self._checked, self._checked_pid = set(), os.getpid()    # units local_path has checked in this process
        self._build_index(labels)

    # -- the index
    def _build_index(self, labels) -> None:
        """Each shard checked against its manifest and mapped (its layers' offsets and size kept for the batch reads),
        its sentences indexed (MappedIndex); the first _MAPS maps kept for the batches to copy from."""
        def units():
            for u, (k, i) in enumerate(self.units):
                out = self.outputs[k]
                local = is_local_fs(out.fs)     # a remote shard's digest: checked as the cache copies it
                where = out.shard_path(i, "arrow", check=True, digest=None if local else False)   # before a copy or map
                b, base, size, st = _map(self.local_path(u), where, read_around=False)  # pages read as the index touches
                if local:                       # the file mapped is the one checked (a stat where it is unchanged)
                    out.shard_path(i, "arrow", check=True)
                out.check_arrow(i, b, where, size=size)
                self.files.found(u, layer_offsets(b, base, size, self.layers, where), size, (st.st_dev, st.st_ino))
                yield sentence_index(b)
                set_read_around(base, size, True)                           # the vectors' first reads: read ahead
                if len(self._maps) < _MAPS:                                 # the maps batches copy from, as indexed
                    self._maps[u] = (b, [flat_vectors(b, name) for name in self.layers])
        self.index = MappedIndex(units(), labels, self.label_key)

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype of the stored vectors (float16 or float32: the output's --dtype)."""
        return np.dtype(self.outputs[0].dtype)

    def index_bytes(self) -> int:
        """Bytes of the in-memory index (MappedIndex.nbytes)."""
        return self.index.nbytes()

    @property
    def lengths(self) -> np.ndarray:
        """(len(self),) tokens of each sentence."""
        return self.index.lengths

    @property
    def unlabelled(self) -> int:
        return self.index.unlabelled

    def __len__(self) -> int:
        return len(self.index.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.index.lengths.sum())

    def position(self, sentence_id: str) -> int:
        """The dataset position of a sentence id; KeyError if absent (MappedIndex.position)."""
        return self.index.position(sentence_id)

    # -- the mapped shards (opened lazily in each process: DataLoader workers map the files themselves)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _open(self, u: int) -> tuple[pa.RecordBatch, list[np.ndarray]]:
        """Unit u's mapped batch and (N, D_k) views of its selected layers: the map the index was built from, or,
        in a forked or unpickled copy or once the _MAPS most recently used maps left it out, the file mapped again
        (DamagedOutput when it is no longer the file indexed). Thread-safe without a lock: a map another thread
        drops stays mapped while anything views it."""
        if self._pid != os.getpid():
            self._maps, self._pid = {}, os.getpid()
        m = self._maps.pop(u, None)
        if m is None:
            local = self.local_path(u)
            b, _, _, st = _map(local, local)
            self.files.indexed(u, st, local)
            m = (b, [flat_vectors(b, name) for name in self.layers])
            self.prefetch_after(u)
        self._maps[u] = m                               # most recently used last
        while len(self._maps) > _MAPS:
            try:
                self._maps.pop(next(iter(self._maps)), None)
            except (StopIteration, RuntimeError):       # another thread changed the maps meanwhile
                break
        return m

    def __del__(self, _getpid=os.getpid):             # os may be gone when the interpreter ends
        files = getattr(self, "files", None)
        if files is not None:
            files.close()
        pool = self.__dict__.get("pool")
        if pool is not None:
            pool.close(_getpid)

    def local_path(self, u: int) -> str:
        """A local path of unit u's Arrow shard: the shard itself, checked against its record the first time this
        process reads it (an unpickled or forked copy too: ElmoOutput.shard_path), or its copy in the cache."""
        k, i = self.units[u]
        out = self.outputs[k]
        if not is_local_fs(out.fs):
            return self.cache.local(out, out.shard_path(i, "arrow"))
        if self._checked_pid != os.getpid():
            self._checked, self._checked_pid = set(), os.getpid()
        if u in self._checked:
            return out.shard_path(i, "arrow")
        path = out.shard_path(i, "arrow", check=True)
        self._checked.add(u)
        return path

    def prefetch_after(self, u: int) -> None:
        """Start copying unit u + 1's shard when unit u's is remote (read-ahead)."""
        if not is_local_fs(self.outputs[self.units[u][0]].fs) and u + 1 < len(self.units):
            k, i = self.units[u + 1]
            self.cache.prefetch(self.outputs[k], self.outputs[k].shard_path(i, "arrow"))

    # -- records
    def views(self, i: int) -> list[np.ndarray]:
        """The stored (T, D_k) arrays of record i, one per selected layer: views of the mapped file."""
        return self._sentence(self.index.global_position(i))

    def _layer_views(self, u: int) -> list[np.ndarray]:
        """(N, D_k) views of unit u's selected layers (kept beside the mapped batch)."""
        return self._open(u)[1]

    def _sentence(self, p: int, u: int | None = None) -> list[np.ndarray]:
        """The selected layers' stored (T, D_k) rows of global position p (in unit u, found when not given):
        views of the mapped file, no copy, once its file is no shorter than when indexed (a mapped page past a
        file's end faults: SIGBUS)."""
        u = self.index.unit(p)[0] if u is None else u
        views = self._layer_views(u)
        self.files.check_mapped(u, self.local_path)
        a, n = int(self.index.starts[p]), int(self.index.all_lengths[p])
        return [v[a: a + n] for v in views]

    def __getitem__(self, i: int) -> dict:
        p = self.index.global_position(i)
        where = self.index.unit(p)
        r = self.index.meta(p, where)
        if self.with_tokens:
            r["tokens"] = self._tokens(p)
        if self.index.labels is not None:
            r[self.label_key] = self.index.labels[i % len(self)]
        r["layers"] = stack(self._sentence(p, where[0]), self.dim)
        return self.transform(r) if self.transform else r

    def by_id(self, sentence_id: str) -> dict:
        return self[self.position(sentence_id)]

    def batch(self, positions: Sequence[int], pin_memory: bool = False, batcher: Batcher | None = None,
              packed: bool = False) -> dict:
        """A padded batch of the records at `positions`: layers (B, L, T, dim) in `dtype` (layer 0 duplicated,
        zero past each length), mask (B, T) bool, lengths (B,) int64, ids, doc_ids, tokens (lists; tokens
        None unless tokens=True), and label / tags as readers.collate makes them. Built by `batcher` (default
        this thread's batching.Batcher: a tensor of its own per batch, in a kept buffer nothing holds any more).
        packed: the sentences back to back instead, as a stream batch, no padding: vectors (one (N, D_k) tensor
        per layer in `dtype`, layer 0 as stored), starts and lengths (B,) int64 (sentence b is rows
        starts[b]:starts[b] + lengths[b]), ids, doc_ids, tokens, labels."""
        import torch
        kept, pos = self.index.global_positions(positions)
        units = self.index.units_of(pos)
        sources, helper = self._sources(pos, units)
        batcher = batcher or self.pool.of_thread(pin_memory)
        if packed:
            vectors, starts, lengths = batcher.packed(sources, self.widths, self.stored_dtype, helper)
            batch = {"vectors": vectors, "starts": starts, "lengths": lengths}
            T = int(lengths.max()) if len(lengths) else 0
        else:
            out, mask = batcher.from_views(sources, self.widths, self.stored_dtype, helper)
            batch = {"layers": out, "mask": mask,
                     "lengths": torch.from_numpy(self.index.all_lengths[pos].astype(np.int64))}
            T = int(mask.shape[1])
        where = list(zip(units.tolist(), (pos - self.index.unit_first[units]).tolist()))
        batch.update({"ids": [self.index.ids[u][s].as_py() for u, s in where],
                      "doc_ids": [self.index.doc_ids[u][s].as_py() for u, s in where],
                      "tokens": [self._tokens(p) for p in pos.tolist()] if self.with_tokens else [None] * len(pos)})
        if self.index.labels is not None:
            batch[self.label_key] = label_batch([self.index.labels[i] for i in kept.tolist()], T, self.label_key)
        return batch

    def __getitems__(self, positions: Sequence[int]) -> dict:
        """DataLoader's batched fetch: batch(positions) (packed with packed=True), in this thread's reused buffers
        with reuse=True (in the process that made the dataset's DataLoader: a worker's batches are pickled to it, so
        they are their own)."""
        from torch.utils.data import get_worker_info
        return self.batch(positions, batcher=self.pool.of_thread(False, reused=True)
                          if self.reuse and get_worker_info() is None else None, packed=self.packed)

    def _sources(self, pos: np.ndarray, units: np.ndarray) -> tuple[list, Any]:
        """(each position's (n, D_k) views of its layers, the helper executor or None) of global positions pos (in
        shards `units`), once no shard of the batch is shorter than when the index was built (a mapped page past a
        file's end faults: SIGBUS)."""
        lengths = self.index.all_lengths[pos]
        ul = units.tolist()
        distinct = list(dict.fromkeys(ul))
        self.files.check(distinct, self.local_path)
        helper = self.pool.helper(int(lengths.sum()) * int(self.files.rows.sum()))
        views = {u: self._layer_views(u) for u in distinct}
        return [[v[a: a + n] for v in views[u]]
                for u, a, n in zip(ul, self.index.starts[pos].tolist(), lengths.tolist())], helper

    def _tokens(self, p: int) -> list[str]:
        u, _ = self.index.unit(p)
        return self._open(u)[0].column("token").slice(int(self.index.starts[p]), int(self.index.all_lengths[p])).to_pylist()

    def batches(self, sampler: "BucketBatchSampler | None" = None, batch_size: int = 32, reuse: bool = False,
                pin_memory: bool = False, ahead: int = 0, packed: bool = False) -> Iterator[dict]:
        """Padded batches in the sampler's order (default: every sentence in order, `batch_size` at a time),
        built by a background thread `ahead` batches ahead (default 0: in this thread; see stream). Each batch a
        tensor of its own, as batch() makes them (the building thread's kept buffers, from epoch to epoch); reuse:
        batches built into buffers kept between batches (each valid until the next: the fastest form for a
        training loop that moves or consumes a batch before asking for the next; ahead + 2 of them with ahead),
        and kept by the dataset when the iteration ends for the next call (the next epoch builds in buffers
        already in memory; so the last batch of one call is valid until the next call's first); packed: batch()'s
        packed form (the sentences back to back, no padding)."""
        plan = sampler if sampler is not None else (range(s, min(s + batch_size, len(self)))
                                                    for s in range(0, len(self), batch_size))
        if not reuse:                                       # batch()'s own Batcher of the building thread
            return read_ahead((self.batch(list(positions), pin_memory, packed=packed) for positions in plan), ahead)
        n = ahead + 2 if ahead > 0 else 1
        batchers = self.pool.lend(n, pin_memory)
        return self.pool.giving_back(read_ahead((self.batch(list(positions), pin_memory, batchers[j % n], packed)
                                                 for j, positions in enumerate(plan)), ahead), batchers, pin_memory)

    def stream(self, batch_tokens: int | None = None, layers: Sequence[str] | None = None, padded: bool = False,
               pin_memory: bool = False, ahead: int = 0) -> Iterator[dict]:
        """Every sentence of the dataset in file order (output, shard, id), in batches of consecutive sentences
        spanning at most `batch_tokens` rows (a longer sentence alone; default: the rows of 8 MiB of the selected
        layers' stored vectors, and with padded=True by default no more than make a padded batch (B, L, T, dim)
        of 6 MiB in its dtype, so that it stays in the CPU cache: B x T <= 512 tokens of the original width in
        float32, 1024 in float16, fewer sentences where one is long). Each layer's rows of a batch are one byte
        range of the shard: one pread per layer straight into a reused buffer (pinned with pin_memory when CUDA is
        there), no per-sentence work; with threads=2 a batch of 1 MiB or more is split in two halves of its
        sentences, the helper thread reading (and padding) the second.

        Yields dicts: vectors, one (N, D_k) tensor per layer in the stored dtype (views of the reused
        buffer: valid until the next batch, clone to keep); starts, lengths (B,) int64: sentence b is rows
        starts[b]:starts[b] + lengths[b] of each (a labelled dataset skips the unlabelled rows between);
        ids, doc_ids (lists), the label as batch() gives it; padded=True adds layers (B, L, T, dim) in
        `dtype` (layer 0 duplicated, zero past each length; a reused buffer too) and mask (B, T) bool.
        layers: a subset of the dataset's layers (default all). ahead: batches read by a background thread
        ahead of the consumer (stream_rows.read_ahead; default 0: in this thread; it pays only when each
        batch's step takes longer than its build: docs/downstream.md)."""
        return stream_batches(self, batch_tokens, layers, padded, pin_memory, ahead)


def _map(local: str, where: str, read_around: bool = True) -> tuple[pa.RecordBatch, int, int, os.stat_result]:
    """(record batch, address of the map's first byte, file size, the file's os.stat) of the local shard file
    `local`, memory-mapped (read_around: as arrow_shards.map_arrow_shard); DamagedOutput naming `where` when another
    file was renamed over it while it was mapped (its identity is taken before and after the map)."""
    st = regular(os.stat(local), where)             # a FIFO's open would block
    b, base, size = map_arrow_shard(local, read_around=read_around)
    if not os.path.samestat(st, os.stat(local)):
        raise DamagedOutput(f"{where}: replaced while the dataset was opened (open it again)")
    return b, base, size, st


def unbatched(batch: dict) -> dict:
    """collate_fn for DataLoader(MappedDataset, batch_sampler=...): the dataset's __getitems__ already made
    the batch."""
    return batch
