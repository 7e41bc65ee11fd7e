"""MappedDataset's Batchers and read helper thread, per process (downstream/mapped.py): a Batcher per thread for
batch() (plain or pinned; each batch a tensor of its own, or in reused buffers), the reuse=True Batchers that
finished batches() iterations give back for the next, and the second read thread. A forked or unpickled copy
starts empty: DataLoader workers build their own. No Beam import.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from elmo_pipeline.downstream.batching import Batcher

SPLIT_BYTES = 1 << 20                       # a batch of at least this many stored bytes is read by two threads
CPUS = os.cpu_count() or 1


class BatcherPool:
    """For batches of `dim` wide layers in dtype `dtype` (a numpy dtype name); `threads`: 2 lets a helper thread
    read half of a batch of SPLIT_BYTES or more (one a process), 1 reads in the caller's thread only."""

    def __init__(self, dim: int, dtype: str, threads: int):
        self.dim, self.dtype, self.threads = dim, dtype, threads
        self._fresh()

    def _fresh(self) -> None:
        self._pid, self._local, self._free, self._helper = os.getpid(), threading.local(), {False: [], True: []}, None

    def _here(self) -> None:
        if self._pid != os.getpid():        # a forked copy: nothing of the parent's threads or buffers
            self._fresh()

    def __getstate__(self) -> dict:
        return {"dim": self.dim, "dtype": self.dtype, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fresh()

    def new(self, pin_memory: bool, reuse: bool = True) -> Batcher:
        return Batcher(self.dim, self.dtype, reuse=reuse, pin_memory=pin_memory)

    def of_thread(self, pin_memory: bool, reused: bool = False) -> Batcher:
        """This thread's Batcher for batch() (its kept buffers reused, each batch a tensor of its own), or with
        `reused` its Batcher(reuse=True) (each batch in the same buffers)."""
        self._here()
        key = ("pinned" if pin_memory else "plain") + ("_reused" if reused else "")
        b = getattr(self._local, key, None)
        if b is None:
            b = self.new(pin_memory, reuse=reused)
            setattr(self._local, key, b)
        return b

    def free(self, pin_memory: bool) -> list[Batcher]:
        """The reuse=True Batchers finished batches() iterations of this process gave back (pinned or not)."""
        self._here()
        return self._free[bool(pin_memory)]

    def lend(self, n: int, pin_memory: bool) -> list[Batcher]:
        """n reuse=True Batchers for one batches() iteration: those given back first, new ones for the rest."""
        free = self.free(pin_memory)
        got = [free.pop() for _ in range(min(n, len(free)))]
        return got + [self.new(pin_memory) for _ in range(n - len(got))]

    def giving_back(self, items: Iterator, batchers: list[Batcher], pin_memory: bool) -> Iterator:
        """The items; once they end (or the iteration is closed, its read-ahead thread stopped), `batchers` go
        back for the next iteration."""
        try:
            yield from items
        finally:
            self.free(pin_memory).extend(batchers)

    def helper(self, nbytes: int) -> ThreadPoolExecutor | None:
        """The executor of this process's second read thread, for a batch of nbytes stored bytes (None when one
        thread reads it: threads=1, one CPU, or a batch too small to pay for the hand-over)."""
        if self.threads < 2 or CPUS < 2 or nbytes < SPLIT_BYTES:
            return None
        self._here()
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="elmo-read")
        return self._helper

    def close(self, _getpid=os.getpid) -> None:          # os may be gone when the interpreter ends
        if self.__dict__.get("_helper") is not None and self._pid == _getpid():
            self._helper.shutdown(wait=False)
