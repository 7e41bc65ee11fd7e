"""Read elements below the file: Split (a whole file, a byte range of a line file, or a run of a Parquet file's row
groups) and Range (a byte range's reads). The launcher plans them (pipeline/read_plan.py); the workers read them
(transforms/read.py). No Beam import.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """A read element: file `index` (into the plan's files), bytes [start, end) of a line file or row groups
    [start, end) of a Parquet file (end -1: to the end, a whole file), the 1-based number of its first
    record, and its place `part` of `parts` in the file."""
    index: int
    start: int = 0
    end: int = -1
    first: int = 1
    part: int = 0
    parts: int = 1

    @property
    def whole(self) -> bool:
        return self.parts == 1


class Range:
    """read() of bytes [start, end) of a seekable binary file object."""

    def __init__(self, f, start: int, end: int):
        f.seek(start)
        self.f, self.left = f, end - start

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        b = self.f.read(n) if n else b""
        self.left -= len(b)
        return b
