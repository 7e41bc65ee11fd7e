"""The one batch builder: every padded batch, stacked record and label batch of the readers is made here.
No Beam import.

A batch is layers (B, L, T, dim) (layer 0, stored P wide, duplicated to [x, x] as AllenNLP does; zero past each
length), mask (B, T) bool, lengths (B,) int64, and labels as `label_batch` makes them; a packed batch is one
(N, D_k) tensor per layer, the sentences back to back with no padding (a stream batch's form). Three sources:
views of mapped shards (`from_views`: numpy copies each straight into its place, layer 0 into both halves; for
another dtype the batch is built so in the stored one, then converted by one torch copy of it; the caller and a
helper thread copy half the sentences each; `packed`: the same copies back to back); per-layer (T_b, D_k) arrays
or tensors of any dtype (`from_sentences`: one torch copy a sentence and layer, another dtype converted on the way,
never by numpy); flat rows of consecutive sentences (`from_rows`, a stream's: put once a layer into a kept table,
layer 0 duplicated, the dtype converted, the batch then gathered by one index_select, a zero row for the padding).
`Batcher(reuse=True)` builds into buffers kept from batch to batch (a batch is valid until the next one);
without reuse a batch is a tensor of its own, built in a kept buffer nothing holds any more (no page faults of
a new allocation); pinned when CUDA is there and pin_memory is asked.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from elmo_pipeline.downstream.stream_rows import halves


def place(dst, src) -> None:
    """Copy rows (..., d) (an array or a tensor) into dst (..., dim; an array or a tensor, strided too): a
    d = dim / 2 wide layer 0 into both halves (AllenNLP's [x, x]); another dtype converted by torch in one call
    (numpy's float16 conversion is several times slower); nothing when src is dst."""
    import torch
    d, dim = src.shape[-1], dst.shape[-1]
    if d != dim and 2 * d != dim:
        raise ValueError(f"layer width {d} is neither {dim} nor half of it")
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray) and src.dtype == dst.dtype:
        dst[..., :d] = src
        if d != dim:
            dst[..., d:] = src
        return
    t = src if isinstance(src, torch.Tensor) else tensor(np.asarray(src))
    o = dst if isinstance(dst, torch.Tensor) else tensor(dst)
    if d == dim:
        if t.data_ptr() != o.data_ptr() or t.dtype != o.dtype:
            o.copy_(t)
        return
    o.unflatten(-1, (2, d)).copy_(t.unsqueeze(-2).expand(*t.shape[:-1], 2, d))


def stack(arrays: Sequence, dim: int) -> np.ndarray:
    """(L, T, dim) float32 of per-layer (T, D_k) arrays or tensors (views of a mapped file too): each copied into
    place, float32 arrays by numpy, another dtype converted by torch (one call a layer); a P-wide layer 0 into the
    first half, the second half then copied from it ([x, x])."""
    import torch
    out = np.empty((len(arrays), arrays[0].shape[0] if len(arrays) else 0, dim), dtype=np.float32)
    for k, a in enumerate(arrays):
        d = a.shape[-1]
        if d != dim and 2 * d != dim:
            raise ValueError(f"layer width {d} is neither {dim} nor half of it")
        if isinstance(a, np.ndarray) and a.dtype == out.dtype:
            out[k, :, :d] = a
        else:
            torch.from_numpy(out[k, :, :d]).copy_(a if isinstance(a, torch.Tensor) else tensor(np.asarray(a)))
        if d != dim:
            out[k, :, d:] = out[k, :, :d]
    return out


_QUIET = []


def tensor(a: np.ndarray):
    """A torch view of a numpy array, strided and read-only ones too (views of memory-mapped files: read,
    never written; torch warns about those once a process, and that once is silenced here)."""
    import torch
    if _QUIET or a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    _QUIET.append(True)
    return t


def lengths_mask(lengths, T: int):
    """(B, T) bool: True at the first lengths[b] positions of row b."""
    import torch
    lengths = torch.as_tensor(lengths)
    return torch.arange(T)[None, :] < lengths[:, None]


def label_batch(values: list, T: int, key: str):
    """Labels of a batch: "label" (B,) int64 when all ints; "tags" (B, T) int64 padded with -100
    (CrossEntropy's ignore_index) when int lists; other values stay a list."""
    import torch
    if key == "tags" and all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in values):
        tags = torch.full((len(values), T), -100, dtype=torch.int64)
        for b, v in enumerate(values):
            tags[b, : len(v)] = torch.tensor(v, dtype=torch.int64)
        return tags
    if key != "tags" and all(isinstance(v, int) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    return values


class Batcher:
    """Builds padded batches of width `dim` in `dtype` (a numpy dtype name, e.g. "float32").

    reuse: build into buffers kept between calls (each batch valid until the next call; clone to keep);
    pin_memory: pinned buffers when CUDA is available. Without reuse each batch is a tensor of its own, built in
    one of a few kept buffers that nothing outside holds any more (torch's storage use count), else a new one:
    a new allocation's page faults cost more than the batch's reads."""

    POOL = 3                                        # kept buffers for batches of their own

    def __init__(self, dim: int, dtype: str = "float32", reuse: bool = False, pin_memory: bool = False):
        import torch
        self.dim, self.dtype, self.reuse = dim, np.dtype(dtype), reuse
        self.torch_dtype = getattr(torch, self.dtype.name)
        self.pin = pin_memory and torch.cuda.is_available()
        self._bufs: dict = {}
        self._pool: list = []

    def _buffer(self, name: str, shape: tuple, dtype):
        """A tensor of `shape`: a view of the kept buffer `name`, grown when short (to a power of two: few new
        allocations, whose pages fault on first use, as batches grow); a fresh one for the batch's layers unless
        reuse."""
        import torch
        n = math.prod(shape)
        if not self.reuse and name == "layers":
            return self._own(n, dtype).view(shape)
        b = self._bufs.get(name)
        if b is None or b.numel() < n or b.dtype != dtype:
            b = self._bufs[name] = torch.empty(1 << (max(n, 1) - 1).bit_length(), dtype=dtype, pin_memory=self.pin)
        return b[:n].view(shape)

    def _own(self, n: int, dtype):
        """n elements of a tensor no earlier batch still uses: a kept buffer that only the pool holds (the
        storage's use count is 2: the pool's tensor and the count's own reference), else a new one, kept in place
        of a free, smaller one or of the oldest. Pinned buffers are always new (an asynchronous copy may still read
        them); a buffer moved to shared memory (a DataLoader worker's batch, sent to the main process) is forgotten."""
        import torch
        count = getattr(torch._C, "_storage_Use_Count", None)
        if self.pin or count is None:
            return torch.empty(max(n, 1), dtype=dtype, pin_memory=self.pin)[:n]
        self._pool = [b for b in self._pool if not b.is_shared()]      # sent to another process: theirs now
        spare = None
        for i, b in enumerate(self._pool):
            if b.dtype == dtype and count(b.untyped_storage()._cdata) == 2:
                if b.numel() >= n:
                    return b[:n]
                spare = i
        b = torch.empty(1 << (max(n, 1) - 1).bit_length(), dtype=dtype)     # a power of two: room to grow
        if spare is not None:
            self._pool[spare] = b
        else:                                       # the oldest forgotten when all are held (their holders keep them)
            self._pool = self._pool[-(self.POOL - 1):] + [b]
        return b[:n]

    def _table(self, rows: int):
        """A kept (rows + 1, dim) tensor of the batch dtype, its last row zero: the rows a batch gathers from."""
        t = self._buffer("table", (rows + 1, self.dim), self.torch_dtype)
        t[rows].zero_()
        return t

    def destinations(self, n: int, widths: Sequence[int], dtype: np.dtype) -> list:
        """Where from_rows wants each layer's n rows read: the table's rows for a layer as wide as the batch in
        its dtype (from_rows then gathers from them without a copy), None for the others."""
        table = self._table(len(widths) * n)
        return [table[k * n: (k + 1) * n] if w == self.dim and np.dtype(dtype) == self.dtype else None
                for k, w in enumerate(widths)]

    def from_rows(self, vectors: Sequence, starts, lengths, read=None, helper=None) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) of flat (N, D_k) rows per layer, sentence b at rows
        starts[b]:starts[b] + lengths[b] (MappedDataset.stream's vectors): each layer copied once into the
        table (converted, layer 0 duplicated; a layer read straight into the table is not copied), the batch
        gathered from it by one index_select. read(a, b): fills rows a:b of the vectors first (None: they are
        filled). helper: an executor whose thread reads, copies and gathers the second half of the sentences."""
        import torch
        lengths, starts = np.asarray(lengths, np.int64), np.asarray(starts, np.int64)
        N = int(vectors[0].shape[0]) if len(vectors) else 0
        table = self._table(len(vectors) * N)
        base = np.arange(len(vectors), dtype=np.int64) * N
        B, L, T = len(lengths), len(vectors), int(lengths.max()) if len(lengths) else 0
        t = np.arange(T)
        mask = t[None, :] < lengths[:, None]                                                  # (B, T)
        idx = torch.from_numpy(np.where(mask[:, None, :], starts[:, None, None] + base[None, :, None] + t,
                                        len(table) - 1).reshape(B, -1))                       # (B, L * T)
        out = self._buffer("layers", (B, L, T, self.dim), self.torch_dtype)
        flat = out.view(B, -1, self.dim)

        def part(lo: int, hi: int) -> None:
            if hi <= lo:
                return
            a, b = int(starts[lo]), int(starts[hi - 1] + lengths[hi - 1])
            if read is not None:
                read(a, b)
            for k, v in enumerate(vectors):
                place(table[k * N + a: k * N + b], v[a:b])
            torch.index_select(table, 0, idx[lo:hi].reshape(-1), out=flat[lo:hi].view(-1, self.dim))
        halves(part, B, helper)
        return out, torch.from_numpy(mask)

    def from_views(self, sources: Sequence[Sequence[np.ndarray]], widths: Sequence[int], stored: np.dtype,
                   helper=None) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) of B sentences, sources[b] their L (n_b, widths[k]) arrays of the
        `stored` dtype (views of mapped shards): each copied by numpy straight into its place (a layer 0 half as
        wide into both halves), zero past each length; in another dtype the batch is built so in a kept buffer
        of the stored dtype, then converted by one torch copy of the whole (contiguous: torch's fastest
        conversion). helper: an executor whose thread builds the second half of the sentences while the caller
        builds the first (the first copies from a newly mapped shard fault its pages in: two cores do it)."""
        import torch
        B, L = len(sources), len(widths)
        lengths = np.asarray([len(s[0]) for s in sources] if L else [0] * B, np.int64)
        T = int(lengths.max()) if B else 0
        out = self._buffer("layers", (B, L, T, self.dim), self.torch_dtype)
        converted = np.dtype(stored) != self.dtype
        stage = self._buffer("staged", (B, L, T, self.dim), getattr(torch, np.dtype(stored).name)) \
            if converted else out
        whole = stage.numpy()                                       # (B, L, T, dim)
        ln = lengths.tolist()

        def copy(lo: int, hi: int) -> None:
            for b in range(lo, hi):
                n = ln[b]
                for k, src in enumerate(sources[b]):
                    row = whole[b, k]
                    if widths[k] == self.dim:
                        row[:n] = src
                    else:                                   # layer 0 into both halves, read once
                        row[:n].reshape(n, 2, widths[k])[:] = src[:, None]
                if n < T:
                    whole[b, :, n:] = 0
            if converted:
                out[lo:hi].copy_(stage[lo:hi])
        halves(copy, B, helper)
        return out, lengths_mask(torch.from_numpy(lengths), T)

    def packed(self, sources: Sequence[Sequence[np.ndarray]], widths: Sequence[int], stored: np.dtype,
               helper=None) -> tuple:
        """(vectors, starts (B,), lengths (B,)) of B sentences packed back to back, no padding (a stream batch's
        form): vectors[k] (N, widths[k]) in the batch dtype, N the sentences' total length, sentence b at rows
        starts[b]:starts[b] + lengths[b]; layer 0 as stored (P wide). sources[b]: its L (n_b, widths[k]) arrays
        of the `stored` dtype (views of mapped shards), each copied once by numpy into its place; another dtype
        staged in the stored one and converted by one torch copy a layer. helper: as from_views."""
        import torch
        B, L = len(sources), len(widths)
        lengths = np.asarray([len(s[0]) for s in sources] if L else [0] * B, np.int64)
        at = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)                # (B+1,)
        N = int(at[-1])
        room = [0] + np.cumsum([N * w for w in widths]).tolist()
        flat = self._buffer("layers", (max(room[-1], 1),), self.torch_dtype)
        vectors = [flat[room[k]: room[k + 1]].view(N, w) for k, w in enumerate(widths)]
        converted = np.dtype(stored) != self.dtype
        if converted:
            stage = self._buffer("staged", (max(room[-1], 1),), getattr(torch, np.dtype(stored).name))
            dst = [stage[room[k]: room[k + 1]].view(N, w).numpy() for k, w in enumerate(widths)]
        else:
            dst = [v.numpy() for v in vectors]
        rows = at.tolist()

        def copy(lo: int, hi: int) -> None:
            for b in range(lo, hi):
                for k, src in enumerate(sources[b]):
                    dst[k][rows[b]: rows[b + 1]] = src
            if converted:
                for k in range(L):
                    vectors[k][rows[lo]: rows[hi]].copy_(torch.from_numpy(dst[k][rows[lo]: rows[hi]]))
        halves(copy, B, helper)
        return vectors, torch.from_numpy(at[:-1]), torch.from_numpy(lengths)

    def from_sentences(self, sentences: Sequence[Sequence]) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) of sentences, each a list of per-layer (T_b, D_k) arrays or tensors
        (any float dtype; views of a mapped file too), copied straight into the batch, another dtype converted by
        torch on the way (one pass, no scratch buffer)."""
        lengths = [int(s[0].shape[0]) if len(s) else 0 for s in sentences]
        L = len(sentences[0]) if sentences else 0
        T = max(lengths, default=0)
        out = self._buffer("layers", (len(lengths), L, T, self.dim), self.torch_dtype)

        for b, layers in enumerate(sentences):
            n = lengths[b]
            for k, a in enumerate(layers):
                place(out[b, k, :n], a)
            if n < T:
                out[b, :, n:].zero_()
        return out, lengths_mask(lengths, T)

    def records(self, records: Sequence[dict]) -> dict:
        """A batch of records with "layers" (L, T, D) (readers.collate): layers, mask, lengths, ids,
        doc_ids, tokens, and "label" / "tags" when the records have them."""
        import torch
        layers, mask = self.from_sentences([list(r["layers"]) for r in records])
        lengths = [int(r["layers"].shape[1]) for r in records]
        batch = {"layers": layers, "mask": mask, "lengths": torch.tensor(lengths, dtype=torch.int64),
                 "ids": [r["id"] for r in records], "doc_ids": [r.get("doc_id") for r in records],
                 "tokens": [r.get("tokens") for r in records]}
        for key in ("label", "tags"):
            if records and key in records[0]:
                batch[key] = label_batch([r[key] for r in records], int(mask.shape[1]), key)
        return batch
