"""Sentence id -> position over the id columns of memory-mapped Arrow shards, in 16 bytes a sentence. No Beam import.

A sorted array of 64-bit hashes of the ids (uint64) beside their positions (int64); a hit is checked against
the stored id, so hash collisions cost a comparison, never a wrong answer.
"""
from __future__ import annotations

import bisect
import hashlib

import numpy as np
import pyarrow as pa


def id_hash(sentence_id: bytes) -> int:
    """64-bit hash of an id's UTF-8 bytes (the id lookup's key)."""
    return int.from_bytes(hashlib.blake2b(sentence_id, digest_size=8).digest(), "little")


def string_buffers(array: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(offsets (n+1,) int32, data) of a string array: item i is data[offsets[i]:offsets[i+1]], no copy."""
    _, offsets, data = array.buffers()
    offs = np.frombuffer(offsets, np.int32)[array.offset: array.offset + len(array) + 1] if len(array) else \
        np.zeros(1, np.int32)
    return offs, memoryview(data).cast("B") if data is not None else memoryview(b"")


class IdTable:
    """Positions of the ids of several string arrays read as one (positions run array after array).

    ids: the arrays (each a shard's sentence ids); firsts: the position of each array's first id, then the
    total (len(ids) + 1,). The hashes are built here (one pass over every id); the arrays' string buffers
    are views, rebuilt after unpickling.
    """

    def __init__(self, ids: list[pa.Array], firsts: list[int]):
        self.ids, self.firsts = ids, firsts
        self._buffers: list[tuple[np.ndarray, memoryview]] | None = None
        self._views: tuple | None = None
        hashes = np.fromiter((id_hash(data[offs[s]: offs[s + 1]]) for offs, data in self.buffers()
                              for s in range(len(offs) - 1)), dtype=np.uint64, count=firsts[-1])
        order = np.argsort(hashes, kind="stable")
        self.hashes, self.positions = hashes[order], order.astype(np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buffers": None, "_views": None}

    @property
    def nbytes(self) -> int:
        return self.hashes.nbytes + self.positions.nbytes

    def buffers(self) -> list[tuple[np.ndarray, memoryview]]:
        """string_buffers of each id array (built on first use)."""
        if self._buffers is None:
            self._buffers = [string_buffers(a) for a in self.ids]
        return self._buffers

    def _lookup_views(self) -> tuple:
        """(hashes, positions, [(offsets, data)] per array) as memoryviews of the arrays (built on first use):
        a lookup indexes them for Python ints, without numpy scalars."""
        if self._views is None:
            flat = lambda a, code: memoryview(np.ascontiguousarray(a)).cast("B").cast(code)    # noqa: E731
            self._views = (flat(self.hashes, "Q"), flat(self.positions, "q"),
                           [(flat(offs, "i"), data) for offs, data in self.buffers()])
        return self._views

    def find(self, key: bytes) -> int | None:
        """The position of the id whose UTF-8 bytes are `key`, or None."""
        hashes, positions, strings = self._lookup_views()
        h = id_hash(key)
        k = bisect.bisect_left(hashes, h)
        while k < len(hashes) and hashes[k] == h:
            p = positions[k]
            u = bisect.bisect_right(self.firsts, p) - 1
            offs, data = strings[u]
            s = p - self.firsts[u]
            if data[offs[s]: offs[s + 1]] == key:
                return p
            k += 1
        return None
