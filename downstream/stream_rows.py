"""The row reads behind MappedDataset.stream: which consecutive sentences make each batch, one pread per layer
into a reused buffer (batching.Batcher pads them). No Beam import."""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset` (preadv, repeated over short reads)."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise EOFError(f"file ends before byte {offset + len(view)}")
        view, offset = view[n:], offset + n


def halves(fn, n: int, helper=None) -> None:
    """fn(0, n), or fn(0, n // 2) here while helper (an executor) runs fn(n // 2, n); the helper's error raised."""
    if helper is None or n < 2:
        fn(0, n)
        return
    rest = helper.submit(fn, n // 2, n)
    try:
        fn(0, n // 2)
    finally:
        rest.result()


def stream_plan(kept: np.ndarray, firsts: Sequence[int], starts: np.ndarray, lengths: np.ndarray,
                batch_tokens: int, padded_tokens: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(unit, global positions (B,), dataset positions (B,)) of each stream batch: consecutive positions
    of one unit whose rows span at most batch_tokens (or one sentence) and, when padded_tokens, whose padded
    batch holds at most padded_tokens tokens (B x its longest sentence).

    kept: the global positions read, sorted (S,) int64; firsts: each unit's first global position, then the
    total (U+1,); starts, lengths: each global position's first row in its shard and its rows."""
    plan = []
    for u in range(len(firsts) - 1):
        lo, hi = np.searchsorted(kept, firsts[u: u + 2])
        j = lo
        while j < hi:
            first, longest, k = int(starts[kept[j]]), int(lengths[kept[j]]), j + 1
            while k < hi:
                n = int(lengths[kept[k]])
                longest = max(longest, n)
                if int(starts[kept[k]]) + n - first > batch_tokens or \
                        padded_tokens and (k + 1 - j) * longest > padded_tokens:
                    break
                k += 1
            plan.append((u, kept[j:k], np.arange(j, k)))
            j = k
    return plan


class RowBuffer:
    """One reused byte buffer with a 64-byte aligned region per layer, each `rows` rows of its width.

    widths: bytes per row of each layer; dtype: the stored dtype (numpy); pin_memory: pinned when CUDA is
    there."""

    def __init__(self, rows: int, widths: Sequence[int], dtype: np.dtype, pin_memory: bool = False):
        import torch
        self.widths, self.dtype = list(widths), dtype
        self.torch_dtype = getattr(torch, dtype.name)
        region = [-(-rows * w // 64) * 64 for w in self.widths]            # each layer's share, 64-byte aligned
        self.buf = torch.empty(sum(region), dtype=torch.uint8, pin_memory=pin_memory and torch.cuda.is_available())
        self.view, self.base = memoryview(self.buf.numpy()), np.cumsum([0] + region[:-1]).tolist()

    def views(self, offsets: list[tuple[int, int]], n: int, into: Sequence | None = None) -> list:
        """Where n rows of each layer go: (N, D_k) tensors of the stored dtype viewing the buffer (valid until the
        next batch), or into[k] where given (a contiguous (N, D_k) tensor); offsets: (file offset of row 0,
        bytes per row) of each layer (arrow_shards.layer_offsets)."""
        vectors = []
        for k, ((_, row), at) in enumerate(zip(offsets, self.base)):
            dst = into[k] if into is not None else None
            if dst is None:
                dst = self.buf[at: at + n * row].view(self.torch_dtype).view(n, row // self.dtype.itemsize)
            vectors.append(dst)
        return vectors


def read_rows(fd: int, offsets: list[tuple[int, int]], first: int, vectors: Sequence, a: int, b: int) -> None:
    """Read rows first + a:first + b of each layer (one pread a layer) into rows a:b of vectors[k] (RowBuffer.views)."""
    for (off, row), v in zip(offsets, vectors):
        pread_into(fd, memoryview(v[a:b].numpy()).cast("B"), off + (first + a) * row)


def read_ahead(items: Iterator, depth: int) -> Iterator:
    """The items of `items`, produced by one background thread (started on the first next(), one per iterator)
    up to `depth` ahead of the consumer (preads and torch copies release the GIL, so reading overlaps the
    consumer's work); depth 0: in this thread. Same items, same order. An exception of the producer is raised
    here with its traceback; closing the iterator (or dropping it: a `break`) waits for the item being made,
    closes `items` and ends the thread. A producer that reuses buffers needs depth + 2 of them (one with the
    consumer, depth made, one being made)."""
    if depth <= 0:
        yield from items
        return
    items, end = iter(items), object()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
    try:
        pending = deque(pool.submit(next, items, end) for _ in range(depth + 1))     # + the one being made
        while True:
            x = pending.popleft().result()
            if x is end:
                return
            pending.append(pool.submit(next, items, end))
            yield x
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(items, "close", None)
        if close:
            close()
