"""The one batch builder: every padded batch, stacked record and label batch of the readers is made here.
No Beam import.

A batch is layers (B, L, T, dim) (layer 0, stored P wide, duplicated to [x, x] as AllenNLP does; zero past
each length), mask (B, T) bool, lengths (B,) int64, and labels as `label_batch` makes them. Sentences come
as per-layer (T_b, D_k) arrays (numpy or torch, any float dtype) or `Rows` of a file (read with pread): rows
are read or copied straight into the batch (one pread or slice copy per sentence and layer, no per-row work;
another dtype converted by torch on the way, never by numpy). Flat rows (a stream's consecutive sentences) are
put once a layer into a kept table (layer 0 duplicated, the dtype converted), the padded batch then gathered
from it by one index_select (a zero row for the padding). `Batcher(reuse=True)` builds into buffers
kept from batch to batch (a batch is valid until the next one); without reuse a batch is a tensor of its own,
built in a kept buffer nothing holds any more (no page faults of a new allocation); pinned when CUDA is there
and pin_memory is asked.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from elmo_pipeline.downstream.stream_rows import pread_into


class Rows:
    """n consecutive rows of one layer in a local file: the descriptor batches read with pread (no mapping, no
    page faults), straight into the batch when the layer is as wide as it."""
    __slots__ = ("fd", "offset", "shape", "dtype")

    def __init__(self, fd: int, offset: int, n: int, d: int, dtype: np.dtype):
        self.fd, self.offset, self.shape, self.dtype = fd, offset, (n, d), dtype

    def read_into(self, dst: np.ndarray, scratch) -> None:
        """Fill dst (n, dim) with the rows: one pread straight into dst when the widths and dtypes agree, else
        into scratch(shape, dtype), then placed (a half-width layer 0 into both halves, converted by torch)."""
        if self.shape[1] == dst.shape[1] and self.dtype == dst.dtype:
            pread_into(self.fd, memoryview(dst).cast("B"), self.offset)
        else:
            tmp = scratch(self.shape, self.dtype)
            pread_into(self.fd, memoryview(tmp).cast("B"), self.offset)
            place(dst, tmp)


def place(dst, src) -> None:
    """Copy (n, d) rows (an array, a tensor or Rows) into dst (n, dim, an array or a tensor): a d = dim / 2 wide
    layer 0 into both halves (AllenNLP's [x, x]); another dtype converted by torch in one call (numpy's float16
    conversion is several times slower); nothing when src is dst."""
    import torch
    if isinstance(src, Rows):
        src.read_into(dst, lambda shape, dtype: np.empty(shape, dtype))
        return
    d, dim = src.shape[1], dst.shape[1]
    if d != dim and 2 * d != dim:
        raise ValueError(f"layer width {d} is neither {dim} nor half of it")
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray) and src.dtype == dst.dtype:
        dst[:, :d] = src
        if d != dim:
            dst[:, d:] = src
        return
    t = src if isinstance(src, torch.Tensor) else tensor(np.asarray(src))
    o = dst if isinstance(dst, torch.Tensor) else tensor(dst)
    if d == dim:
        if t.data_ptr() != o.data_ptr() or t.dtype != o.dtype:
            o.copy_(t)
        return
    o.unflatten(1, (2, d)).copy_(t[:, None, :].expand(len(t), 2, d))


def stack(arrays: Sequence, dim: int) -> np.ndarray:
    """(L, T, dim) float32 of per-layer (T, D_k) arrays, tensors or Rows (a P-wide layer 0 becomes [x, x]);
    tensors are copied by torch straight into place (one call a layer)."""
    import torch
    out = np.empty((len(arrays), arrays[0].shape[0] if len(arrays) else 0, dim), dtype=np.float32)
    o = torch.from_numpy(out)
    for k, a in enumerate(arrays):
        if isinstance(a, torch.Tensor):
            place(o[k], a)
        else:
            place(out[k], a if isinstance(a, Rows) else np.asarray(a))
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
        self._rows: np.ndarray | None = None
        self._pool: list = []

    def _buffer(self, name: str, shape: tuple, dtype):
        """A tensor of `shape`: a view of the kept buffer `name`, grown when short; a fresh one for the batch's
        layers unless reuse."""
        import torch
        n = math.prod(shape)
        if not self.reuse and name == "layers":
            return self._own(n, dtype).view(shape)
        b = self._bufs.get(name)
        if b is None or b.numel() < n or b.dtype != dtype:
            b = self._bufs[name] = torch.empty(max(n, 1), dtype=dtype, pin_memory=self.pin)
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

    def _scratch(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A kept numpy buffer of shape and dtype (rows read before they are placed)."""
        n = math.prod(shape) * dtype.itemsize
        if self._rows is None or len(self._rows) < n:
            self._rows = np.empty(n, np.uint8)
        return self._rows[:n].view(dtype).reshape(shape)

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

    def _gather(self, table, base: list[int], starts, lengths) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) gathered by one index_select from `table`: sentence b's rows of
        layer k are table rows base[k] + starts[b] onwards; positions past a length take the zero last row."""
        import torch
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        starts = torch.as_tensor(starts, dtype=torch.int64)
        B, L = len(lengths), len(base)
        T = int(lengths.max()) if B else 0
        mask = lengths_mask(lengths, T)
        rows = starts[:, None] + torch.arange(T)[None, :]                               # (B, T)
        idx = torch.as_tensor(base, dtype=torch.int64)[None, :, None] + rows[:, None, :]   # (B, L, T)
        idx = torch.where(mask[:, None, :], idx, len(table) - 1)
        out = self._buffer("layers", (B, L, T, self.dim), self.torch_dtype)
        torch.index_select(table, 0, idx.view(-1), out=out.view(-1, self.dim))
        return out, mask

    def from_rows(self, vectors: Sequence, starts, lengths) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) of flat (N, D_k) rows per layer, sentence b at rows
        starts[b]:starts[b] + lengths[b] (MappedDataset.stream's vectors): each layer copied once into the
        table (converted, layer 0 duplicated), the batch gathered from it in one call."""
        N = int(vectors[0].shape[0]) if len(vectors) else 0
        table = self._table(len(vectors) * N)
        for k, v in enumerate(vectors):
            place(table[k * N: (k + 1) * N], v)
        return self._gather(table, [k * N for k in range(len(vectors))], starts, lengths)

    def from_sentences(self, sentences: Sequence[Sequence]) -> tuple:
        """(layers (B, L, T, dim), mask (B, T)) of sentences, each a list of per-layer (T_b, D_k) arrays or tensors
        (any float dtype; views of a mapped file too) or Rows, read or copied straight into the batch, another
        dtype converted by torch on the way (one pass, no scratch buffer)."""
        import torch
        lengths = [int(s[0].shape[0]) if len(s) else 0 for s in sentences]
        L = len(sentences[0]) if sentences else 0
        arrays = [[a if isinstance(a, Rows) else a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for a in s]
                  for s in sentences]
        T = max(lengths, default=0)
        out = self._buffer("layers", (len(lengths), L, T, self.dim), self.torch_dtype)
        o = out.numpy()
        flat, row = memoryview(o.reshape(-1)).cast("B"), self.dim * o.itemsize
        for b, (layers, n) in enumerate(zip(arrays, lengths)):
            for k, a in enumerate(layers):
                if isinstance(a, Rows) and a.shape[1] == self.dim and a.dtype == o.dtype:
                    at = (b * L + k) * T * row                      # straight into the batch: one pread
                    pread_into(a.fd, flat[at: at + n * row], a.offset)
                elif isinstance(a, Rows):
                    a.read_into(o[b, k, :n], self._scratch)
                else:
                    place(o[b, k, :n], a)
            if n < T:
                o[b, :, n:] = 0
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
