"""batch_invariant's row rule: every GEMM of the invariant path gives a row the bits a ROW_TILE-row call at 1 thread
gives it.

A CPU GEMM library picks its kernel (blocking, reduction order, the threads' split) by the number of rows M, and a
row's bits follow that choice: 1-3 rows take another kernel everywhere measured, and on some kinds so do larger
counts (an Intel Xeon with AMX in bf16 at 1 thread: a (4096 -> 512) projection gives other bits from 36 rows up) or
another thread count. So the invariant path pads every GEMM's rows to a multiple of ROW_TILE (the token encoder its
tokens, the LSTMs each step) and calls each GEMM (in_pieces) only with row counts this process has checked for that
GEMM (RowRule, one per op, shape, dtype, post-op and thread count: row_rule_of): the first time a count is used, the
GEMM runs at that count and each row is compared with the same row in a ROW_TILE-row call at 1 thread; a count that
moves a row's bits is cut into smaller checked ones, and a GEMM whose 4-row bits move with the thread count runs at
1 thread. The check's GEMM is the op of the rule's key on weights and rows made for it (check_pair): every output is
exactly 0 in real numbers, the sum of large terms that cancel, so its computed bits are the rounding of the partial
sums and change with any change of the summation order (random rows change an output's last bit only now and then:
1 value in 2,048 for that projection). A row's bits are then those of a ROW_TILE-row call at 1 thread, on any kind
and at any thread count, by construction (docs/exactness.md).
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


# A rule's check: (like, dim) -> (the check's GEMM as a pure function of its rows, the rows it is checked on)
Probe = Callable[[Tensor, int], tuple[Callable[[Tensor], Tensor], Tensor]]


class RowRule:
    """One GEMM's row rule in this process (row_rule_of): which row counts give every row the bits a ROW_TILE-row
    call at 1 thread gives it, each count checked the first time it is used, and the threads the GEMM runs at (those
    asked, or 1 where the thread count itself moves a 4-row call's bits: decided on first use). probe(like, dim): the
    check's GEMM as a pure function of its rows and the rows it is checked on, shaped like `like` with CHECK_BLOCK
    rows along dim (check_pair for the ops the path calls)."""

    def __init__(self, name: str, threads: int, probe: Probe):
        self.name, self.asked, self.threads = name, threads, threads
        self.kept: dict[int, bool] = {}
        self._probe = probe
        self._check: tuple[Callable[[Tensor], Tensor], Tensor, Tensor, int] | None = None   # gemm, block, ref, dim
        self._lock = threading.Lock()

    def cuts(self, n: int, like: Tensor, dim: int = 0) -> list[tuple[int, int]]:
        """[start, end) of the calls n rows (a multiple of ROW_TILE) are made in: at most MAX_ROWS each, each of a
        count that keeps the bits (the largest such, counting down from what is left). like: the real call's rows
        (their layout: rows along dim). Decides the rule's threads first (run the calls at self.threads after this)."""
        if n % ROW_TILE:
            raise ValueError(f"a batch-invariant GEMM call of {n} rows: not a multiple of {ROW_TILE}")
        if self._check is None:
            self._first_use(like, dim)
        out, s = [], 0
        while s < n:
            m = min(n - s, MAX_ROWS)
            while m > ROW_TILE and not self.keeps(m, like, dim):
                m -= ROW_TILE
            out.append((s, s + m))
            s += m
        return out

    def keeps(self, m: int, like: Tensor, dim: int = 0) -> bool:
        """Whether m rows give every row its 4-row bits (checked once: the probe on its CHECK_BLOCK rows repeated to
        m, at self.threads, against the block in ROW_TILE-row calls at 1 thread)."""
        kept = self.kept.get(m)
        if kept is not None:                       # checked: no lock on the hot path
            return kept
        if self._check is None:
            self._first_use(like, dim)
        gemm, block, ref, dim = self._check
        with self._lock:
            if m not in self.kept:
                with threads_set(self.threads):
                    self.kept[m] = torch.equal(gemm(_tiled(block, m, dim)), _tiled(ref, m, dim))
                if not self.kept[m]:
                    logging.getLogger(__name__).info(
                        "batch-invariant: the GEMM %s at %d threads gives a row other bits at %d rows than at %d rows "
                        "and 1 thread: called in smaller pieces", self.name, self.threads, m, ROW_TILE)
            return self.kept[m]

    def _first_use(self, like: Tensor, dim: int) -> None:
        """The check's GEMM, rows and reference, and the threads: 1 where the asked count moves a 4-row call's bits
        (any of the block's)."""
        with self._lock:
            if self._check is not None:
                return
            gemm, block = self._probe(like, dim)
            ref = _chunks_of(gemm, block, dim, 1)
            if self.asked > 1 and not torch.equal(_chunks_of(gemm, block, dim, self.asked), ref):
                self.threads = 1           # the thread count itself moves a row's bits: this GEMM runs at 1 thread
                logging.getLogger(__name__).info(
                    "batch-invariant: the GEMM %s gives a row other bits at %d threads than at 1: run at 1 thread",
                    self.name, self.asked)
            self.kept[ROW_TILE] = True
            self._check = gemm, block, ref, dim


def _chunks_of(probe: Callable[[Tensor], Tensor], block: Tensor, dim: int, threads: int) -> Tensor:
    """probe over block in ROW_TILE-row calls at `threads` torch threads."""
    with threads_set(threads):
        return torch.cat([probe(block.narrow(dim, i, ROW_TILE)) for i in range(0, block.shape[dim], ROW_TILE)], dim)


def check_pair(k: int, n: int, like: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Weights (n, k) and CHECK_BLOCK rows (like's shape, CHECK_BLOCK along dim, k last) whose products cancel
    exactly: W = [U, -U[:, p]] and x = [a, a[..., p]] for a permutation p of the first half, so every x @ W.T is 0
    in real numbers and its computed bits are the rounding of partial sums of about 2**15 (a zero column where k is
    odd). Any change of the order or blocking of the k-sum moves a good share of them (through a tanh, inside a
    hardtanh's clip, and through a sigmoid with _onednn's bias: tests/test_row_rule.py)."""
    g = torch.Generator().manual_seed(0)
    half = k // 2
    p = torch.randperm(half, generator=g)
    u = torch.randn(n, half, generator=g).to(like.dtype).float()
    shape = list(like.shape)
    shape[dim], shape[-1] = CHECK_BLOCK, half
    a = (torch.randn(shape, generator=g) * (2 ** 15 / max(k, 1) ** 0.5)).to(like.dtype).float()
    odd = [torch.zeros(n, k - 2 * half)], [torch.zeros(*shape[:-1], k - 2 * half)]
    w = torch.cat([u, -u[:, p], *odd[0]], 1).to(like.dtype).to(like.device)
    x = torch.cat([a, a[..., p], *odd[1]], -1).to(like.dtype).to(like.device)
    return w, x


def _onednn(k, n, like, dim, act="none", *rest):
    """oneDNN's linear (model/onednn.py) with a post-op (act, its scalars) and a bias where rest ends in 'bias': -8
    before a sigmoid (its outputs near 0.5 round the sums' last bits away in bf16, near e**-8 they keep them), else 0."""
    w, x = check_pair(k, n, like, dim)
    bias = None
    if rest[-1:] == ("bias",):
        bias = torch.full((n,), -8.0 if act == "sigmoid" else 0.0, dtype=w.dtype)
    scalars = [r for r in rest if r != "bias"]
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    return (lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, act, scalars, "")), x


def _linear(k, n, like, dim):
    w, x = check_pair(k, n, like, dim)
    bias = torch.zeros(n, dtype=w.dtype, device=w.device)
    return (lambda rows: torch.nn.functional.linear(rows, w, bias)), x


def _mm(k, n, like, dim):
    w, x = check_pair(k, n, like, dim)
    wt = w.t().contiguous()
    return (lambda rows: torch.mm(rows, wt)), x


def _bmm(k, n, like, dim):
    """torch.bmm over like's leading batch (the directions): (G, rows, k) @ (G, k, n)."""
    w, x = check_pair(k, n, like, dim)
    wt = w.t().contiguous().expand(like.shape[0], k, n).contiguous()
    return (lambda rows: torch.bmm(rows.contiguous(), wt)), x


def _addmm(k, n, like, dim):
    """The bmm loop's recurrent GEMM: per direction g, acc[g].addmm_(rows[g], W.T), acc from the rows (so a row's
    sum starts from its own values, as the gates' do)."""
    w, x = check_pair(k, n, like, dim)
    wt = w.t().contiguous()

    def gemm(rows):
        acc = (rows[..., :1] * 2 ** -15).expand(-1, -1, n).contiguous()
        for g in range(rows.shape[0]):
            acc[g].addmm_(rows[g], wt)
        return acc
    return gemm, x


# The ops the invariant path calls, by the name its row_rule_of key starts with: (K, N, like, dim, *post-op) -> the
# check's (GEMM on weights from check_pair, its rows)
PROBES = {"onednn": _onednn, "linear": _linear, "mm": _mm, "bmm": _bmm, "addmm": _addmm}


_RULES: dict[tuple, RowRule] = {}
_RULES_LOCK = threading.Lock()


def row_rule_of(*shape, threads: int | None = None) -> RowRule:
    """The process's RowRule of a GEMM: shape names it (op, K, N, dtype, post-op...: whatever picks its kernel but
    the row count; op one of PROBES), threads: the torch threads it is called at (None: this thread's count)."""
    if shape[0] not in PROBES:
        raise ValueError(f"no row check for the GEMM op {shape[0]!r}: one of {sorted(PROBES)}")
    threads = threads or torch.get_num_threads()
    key = (*shape, threads)
    with _RULES_LOCK:
        if key not in _RULES:
            op, k, n, dtype, *post = shape
            _RULES[key] = RowRule(" ".join(map(str, shape)), threads,
                                  lambda like, dim: PROBES[op](k, n, like, dim, *post))
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
    cuts = rule.cuts(x.shape[dim], x, dim)
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
