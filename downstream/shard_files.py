"""The open shard files that batch reads pread from: a descriptor per shard (the most recently used kept open),
each layer's byte offset in it (found when the index is built). Thread-safe: a descriptor is never closed while a
read holds it. No Beam import."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from elmo_pipeline.downstream.shard_checks import DamagedOutput


class ShardFiles:
    """Descriptors and layer offsets of the shards (units) of a dataset, in this process (a forked or unpickled
    copy opens its own descriptors).

    units: how many shards; layers: how many layers are read; keep: descriptors kept open when idle.
    offsets(u): (L,) int64 file offset of row 0 of each layer of unit u; rows: (L,) bytes per row of each layer
    (the same in every shard: the manifest fixes the widths and dtype). `path` arguments: unit -> a local path
    of its shard."""

    def __init__(self, units: int, layers: int, keep: int = 64):
        self.keep = keep
        self._offsets = np.zeros((units, layers), np.int64)
        self._sizes = np.zeros(units, np.int64)
        self._files = np.zeros((units, 2), np.uint64)                  # (st_dev, st_ino) the index was built from
        self.rows = np.zeros(layers, np.int64)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid, self._open, self._busy = os.getpid(), {}, {}        # unit -> fd (LRU order), unit -> readers

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        state["_open"], state["_busy"] = {}, {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def found(self, u: int, offsets: Sequence[tuple[int, int]], size: int, file: tuple[int, int]) -> None:
        """Keep unit u's (file offset of row 0, bytes per row) of each layer (arrow_shards.layer_offsets), its file
        size and the (st_dev, st_ino) of the file indexed: a descriptor opened later on another file (the shard
        replaced since) is refused."""
        self.rows = np.asarray([r for _, r in offsets], np.int64)
        self._offsets[u] = [o for o, _ in offsets]
        self._sizes[u] = size
        self._files[u] = file

    def offsets(self, u: int) -> np.ndarray:
        """(L,) int64: the file offset of row 0 of each layer of unit u's shard."""
        return self._offsets[u]

    def acquire(self, units: Sequence[int], path: Callable[[int], str]) -> dict[int, int]:
        """{unit: descriptor} of each distinct unit, opened if need be and held until release(); DamagedOutput when a
        shard's file is no longer the one indexed (replaced: its rows are not where the index says)."""
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            fds: dict[int, int] = {}
            try:
                for u in units:
                    if u in fds:
                        continue
                    fd = self._open.pop(u, None)
                    self._open[u] = fds[u] = self._opened(u, path(u)) if fd is None else fd   # most recently used last
                    self._busy[u] = self._busy.get(u, 0) + 1
            except BaseException:
                self._release(fds)
                raise
            self._trim()
            return fds

    def _opened(self, u: int, where: str) -> int:
        """A new descriptor of unit u's shard at `where`, checked to be the file indexed."""
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))     # a FIFO put there: opened, refused
        try:
            self.indexed(u, os.fstat(fd), where)
        except DamagedOutput:
            os.close(fd)
            raise
        return fd

    def indexed(self, u: int, st: os.stat_result, where: str) -> None:
        """DamagedOutput unless `st` (an os.stat of unit u's shard at `where`) is of the file indexed."""
        if (st.st_dev, st.st_ino) != tuple(int(x) for x in self._files[u]):
            raise DamagedOutput(f"{where}: replaced since the dataset was opened (open it again)")

    def release(self, fds: dict[int, int]) -> None:
        """End the reads of acquire's units."""
        with self._lock:
            if self._pid == os.getpid():
                self._release(fds)

    def _release(self, fds: dict[int, int]) -> None:
        for u in fds:
            n = self._busy.pop(u, 1) - 1
            if n > 0:
                self._busy[u] = n
        self._trim()

    def _trim(self) -> None:
        """Close the least recently used idle descriptors beyond `keep`."""
        extra = len(self._open) - self.keep
        if extra <= 0:
            return
        for u in [u for u in self._open if u not in self._busy][:extra]:
            os.close(self._open.pop(u))

    def check(self, units: Sequence[int], path: Callable[[int], str]) -> None:
        """DamagedOutput naming the shards among `units` whose files are now shorter than when the index was built
        (their mapped pages past the new end would fault: SIGBUS)."""
        fds = self.acquire(units, path)
        try:
            cut = [u for u, fd in fds.items() if _size(fd) < self._sizes[u]]
        finally:
            self.release(fds)
        if cut:
            raise self.shorter(cut, EOFError(f"file ends before byte {self._sizes[cut[0]]}"), path)

    def check_mapped(self, u: int, path: Callable[[int], str]) -> None:
        """DamagedOutput naming unit u's shard when the file indexed (the one its map shows) is now shorter than when
        the index was built; a file renamed over the shard's path since, or the path removed, leaves the mapped one
        whole (nothing to check: a record reads the indexed file). The size read from the kept descriptor (the
        indexed file, renamed over or not), else from one opened by the path."""
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            fd = self._open.pop(u, None)
            if fd is None:
                try:
                    fd = self._opened(u, path(u))
                except (DamagedOutput, FileNotFoundError):   # another file or none at the path: the mapped one
                    return                                      # is not cut
            size = _size(fd)
            self._open[u] = fd                          # most recently used last
            self._trim()
        if size < self._sizes[u]:
            raise self.shorter([u], EOFError(f"file ends before byte {self._sizes[u]}"), path)

    def shorter(self, units: Sequence[int], error: EOFError, path: Callable[[int], str]) -> DamagedOutput:
        """The error of a read that found a file ending early: the shards among `units` now shorter than when
        the index was built, named."""
        cut = [path(u) for u in dict.fromkeys(units)
               if not os.path.exists(path(u)) or os.path.getsize(path(u)) < self._sizes[u]]
        return DamagedOutput(f"{', '.join(cut or [path(units[0])])}: {error} (the shard changed after it was "
                             f"opened)")

    def close(self, _getpid=os.getpid, _close=os.close) -> None:     # os may be gone when the interpreter ends
        with self._lock:
            if self._pid == _getpid():
                for fd in self._open.values():
                    _close(fd)
            self._open, self._busy = {}, {}


def _size(fd: int) -> int:
    """The size of an open file: its end's offset (cheaper than fstat; reads use pread, which ignores the
    descriptor's offset)."""
    return os.lseek(fd, 0, os.SEEK_END)
