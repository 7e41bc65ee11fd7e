"""batch_invariant's row rule: every GEMM of the invariant path gives a row the bits a ROW_TILE-row call at 1 thread
gives it.

A CPU GEMM library picks its kernel (blocking, reduction order, the threads' split) by the number of rows M, and a
row's bits follow that choice: 1-3 rows take another kernel everywhere measured, and on some kinds so do larger
counts (an Intel Xeon with AMX in bf16 at 1 thread: a (4096 -> 512) projection gives other bits from 36 rows up) or
another thread count. So the invariant path pads every GEMM's rows to a multiple of ROW_TILE (the token encoder its
tokens, the LSTMs each step) and calls each GEMM (in_pieces) only with row counts this process has checked for that
GEMM (RowRule, one per shape, op, dtype and thread count: row_rule_of): the first time a count is used, the GEMM runs
on random rows at that count and each row is compared with the same row in a ROW_TILE-row call at 1 thread; a count
that moves a row's bits is cut into smaller checked ones, and a GEMM whose 4-row bits move with the thread count
runs at 1 thread. A row's bits are then those of a ROW_TILE-row call at 1 thread, on any kind and at any thread
count, by construction (docs/exactness.md).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable

import torch
from torch import Tensor

ROW_TILE = 4
# The most rows of one batch-invariant GEMM call: a call of more is cut into pieces (bounds the row check's inputs)
MAX_ROWS = 512
# Rows of the random block a row check repeats (its reference: the block in ROW_TILE-row calls at 1 thread)
CHECK_BLOCK = 16


def round_up(n: int, tile: int = ROW_TILE) -> int:
    """The smallest multiple of tile that is >= n."""
    return -(-n // tile) * tile


def _tiled(block: Tensor, m: int, dim: int) -> Tensor:
    """block repeated along dim and cut to m rows there."""
    reps = [1] * block.dim()
    reps[dim] = -(-m // block.shape[dim])
    return block.repeat(*reps).narrow(dim, 0, m)


@contextlib.contextmanager
def threads_set(threads: int):
    """Inside: this thread's torch threads at `threads` (put back after)."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads != before:
            torch.set_num_threads(before)


class RowRule:
    """One GEMM shape's row rule in this process (row_rule_of): which row counts give every row the bits a
    ROW_TILE-row call at 1 thread gives it, each count checked the first time it is used, and the threads the GEMM
    runs at (those asked, or 1 where the thread count itself moves a 4-row call's bits: decided on first use)."""

    def __init__(self, name: str, threads: int):
        self.name, self.asked, self.threads = name, threads, threads
        self.kept: dict[int, bool] = {}
        self._block: Tensor | None = None
        self._lock = threading.Lock()

    def cuts(self, n: int, probe: Callable[[Tensor], Tensor], like: Tensor, dim: int = 0) -> list[tuple[int, int]]:
        """[start, end) of the calls n rows (a multiple of ROW_TILE) are made in: at most MAX_ROWS each, each of a
        count that keeps the bits (the largest such, counting down from what is left). probe: the GEMM as a pure
        function of its rows (along dim, laid out as the real call's), to check a count not seen yet on random rows
        shaped like `like`. Decides the rule's threads first (run the calls at self.threads after this)."""
        if n % ROW_TILE:
            raise ValueError(f"a batch-invariant GEMM call of {n} rows: not a multiple of {ROW_TILE}")
        if self._block is None:
            self._first_use(probe, like, dim)
        out, s = [], 0
        while s < n:
            m = min(n - s, MAX_ROWS)
            while m > ROW_TILE and not self.keeps(m, probe, like, dim):
                m -= ROW_TILE
            out.append((s, s + m))
            s += m
        return out

    def keeps(self, m: int, probe: Callable[[Tensor], Tensor], like: Tensor, dim: int = 0) -> bool:
        """Whether m rows give every row its 4-row bits (checked once: probe on CHECK_BLOCK random rows repeated to
        m, at self.threads, against the same probe on the block in ROW_TILE-row calls at 1 thread)."""
        kept = self.kept.get(m)
        if kept is not None:                       # checked: no lock on the hot path
            return kept
        if self._block is None:
            self._first_use(probe, like, dim)
        with self._lock:
            if m not in self.kept:
                ref = self._reference(probe, dim)
                with threads_set(self.threads):
                    self.kept[m] = torch.equal(probe(_tiled(self._block, m, dim)), _tiled(ref, m, dim))
                if not self.kept[m]:
                    logging.getLogger(__name__).info(
                        "batch-invariant: the GEMM %s at %d threads gives a row other bits at %d rows than at %d rows "
                        "and 1 thread: called in smaller pieces", self.name, self.threads, m, ROW_TILE)
            return self.kept[m]

    def _reference(self, probe: Callable[[Tensor], Tensor], dim: int) -> Tensor:
        """probe on the block in ROW_TILE-row calls at 1 thread (each probe's own: its weights may differ)."""
        return _chunks_of(probe, self._block, dim, 1)

    def _first_use(self, probe: Callable[[Tensor], Tensor], like: Tensor, dim: int) -> None:
        """The random block, and the threads: 1 where the asked count moves a 4-row call's bits (any of the block's)."""
        with self._lock:
            if self._block is not None:
                return
            shape = list(like.shape)
            shape[dim] = CHECK_BLOCK
            block = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(like.dtype).to(like.device)
            if self.asked > 1:
                ref = _chunks_of(probe, block, dim, 1)
                if not torch.equal(_chunks_of(probe, block, dim, self.asked), ref):
                    self.threads = 1       # the thread count itself moves a row's bits: this GEMM runs at 1 thread
                    logging.getLogger(__name__).info(
                        "batch-invariant: the GEMM %s gives a row other bits at %d threads than at 1: run at 1 thread",
                        self.name, self.asked)
            self.kept[ROW_TILE] = True
            self._block = block


def _chunks_of(probe: Callable[[Tensor], Tensor], block: Tensor, dim: int, threads: int) -> Tensor:
    """probe over block in ROW_TILE-row calls at `threads` torch threads."""
    with threads_set(threads):
        return torch.cat([probe(block.narrow(dim, i, ROW_TILE)) for i in range(0, block.shape[dim], ROW_TILE)], dim)


_RULES: dict[tuple, RowRule] = {}
_RULES_LOCK = threading.Lock()


def row_rule_of(*shape, threads: int | None = None) -> RowRule:
    """The process's RowRule of a GEMM: shape names it (op, K, N, dtype, post-op...: whatever picks its kernel but
    the row count), threads: the torch threads it is called at (None: this thread's count)."""
    threads = threads or torch.get_num_threads()
    key = (*shape, threads)
    with _RULES_LOCK:
        if key not in _RULES:
            _RULES[key] = RowRule(" ".join(map(str, shape)), threads)
        return _RULES[key]


def forget_row_rules() -> None:
    """Drop every RowRule checked so far (tests, benchmarks: the next call checks again)."""
    with _RULES_LOCK:
        _RULES.clear()


def _forget_after_fork() -> None:
    global _RULES_LOCK
    _RULES.clear()                     # a forked child has none of the parent's threads: no lock may stay held
    _RULES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def in_pieces(gemm: Callable[[Tensor], Tensor], x: Tensor, rule: RowRule, out: Tensor | None = None,
              dim: int = 0) -> Tensor:
    """gemm (pure, reading its rows contiguous) over x's rows (along dim, a multiple of ROW_TILE) in rule.cuts at
    rule.threads: gemm(x) itself when that is one call. out: written piece by piece (and returned), else the pieces
    are concatenated. On a device other than the CPU the call stays whole, unchecked (batch invariance is refused
    there: model.device.check_batch_invariant)."""
    if x.device.type != "cpu":
        return gemm(x) if out is None else out.copy_(gemm(x))
    cuts = rule.cuts(x.shape[dim], gemm, x, dim)
    with threads_set(rule.threads):
        if out is None:
            return gemm(x) if len(cuts) == 1 else torch.cat([gemm(x.narrow(dim, a, b - a)) for a, b in cuts], dim)
        for a, b in cuts:
            out.narrow(dim, a, b - a).copy_(gemm(x.narrow(dim, a, b - a)))
        return out


def row_rule() -> dict:
    """The batch-invariant path's row rule as a JSON-able record (for the manifest's kernel path): a row has the bits
    of a row_tile-row call at 1 thread."""
    return {"row_tile": ROW_TILE}
