"""The progress bar of a run: percent and ETA by input bytes, tokens/s beside. No Beam import.

The total is the input files' sizes as stored (known at plan time: pipeline.plan.plan). Each Document carries
its share of its file's bytes (transforms/read.py), split over its sentences by Tokenize (Item.nbytes); the
bar advances when a batch is embedded by the bytes of its sentences, and when input is dropped (blank and
unreadable records, dead-lettered sentences, sentences committed by an interrupted run). So it costs a few
integer additions per sentence and one update per batch, nothing per token.

One bar per worker process (tqdm on its stderr, dropped once that fails: fsio/streams.py Unread): with several local worker processes each one sees its own
part of the input only, which its description says.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from elmo_pipeline.fsio.streams import Unread


@dataclass(frozen=True)
class ProgressSpec:
    """What the workers' bars need: the total input bytes, the input sizes by URL (ReadFiles counts what a
    file's documents do not carry), the number of local worker processes (1: the bar sees the whole run)."""
    total_bytes: int
    sizes: dict = field(default_factory=dict, hash=False, compare=False)
    workers: int = 1


class ByteProgress:
    """A tqdm bar of input bytes (percent, ETA) with the tokens/s since it started in its postfix."""

    def __init__(self, total_bytes: int | None, desc: str, file=None, mininterval: float = 1.0):
        from tqdm import tqdm
        if file is None:            # this process's stderr, never failing the work (a worker process's inherited
            file = sys.stderr       # pipe whose reader is gone: the bar is dropped, fsio/streams.py)
            file = file if isinstance(file, Unread) or file is None else Unread(file, logs=True)
        self.bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                        file=file, mininterval=mininterval, dynamic_ncols=True, smoothing=0.1)
        self.tokens, self.t0 = 0, time.perf_counter()

    def update(self, nbytes: int, tokens: int = 0) -> None:
        if tokens:
            self.tokens += tokens
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{_si(rate)} tok/s", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def description(spec: ProgressSpec) -> str:
    if spec.workers > 1:
        return f"embedding, pid {os.getpid()} (its part of the input only, 1 of {spec.workers} processes)"
    return "embedding"


_BAR: ByteProgress | None = None


def advance(spec: ProgressSpec | None, nbytes: int, tokens: int = 0) -> None:
    """Advance this process's bar (made on first use) by `nbytes` of input and `tokens` embedded."""
    global _BAR
    if spec is None or not (nbytes or tokens):
        return
    if _BAR is None:
        _BAR = ByteProgress(spec.total_bytes, description(spec))
    _BAR.update(nbytes, tokens)


def close() -> None:
    """Close this process's bar, if any (a next run in the process starts a new one)."""
    global _BAR
    if _BAR is not None:
        _BAR.close()
        _BAR = None


def split_bytes(nbytes: int, ends: list[int], length: int) -> list[int]:
    """A document's `nbytes` split over its sentences in proportion to their text, by the sentences' end
    offsets in a text of `length` characters (the last one takes the rest): integers that sum to nbytes."""
    shares, done = [], 0
    for k, end in enumerate(ends):
        upto = nbytes if k == len(ends) - 1 else nbytes * min(end, length) // max(length, 1)
        shares.append(upto - done)
        done = upto
    return shares
