"""MappedDataset's index (downstream/mapped.py): per sentence its shard, token offset and length, id, doc id and
index, the labels kept, and the lookup of a position by id. In memory: an int64 offset and an int32 length a
sentence, its id and doc id (copied from the shards: a shard's map may be dropped), the id hash table once built
(downstream/id_table.py: 16 bytes a sentence). No Beam import.

Positions: a global position p runs over every sentence of every unit (shard) in order; a dataset position i runs
over the kept ones (the labelled sentences when labels are given), i -> keep[i] = p.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from elmo_pipeline.downstream.id_table import IdTable
from elmo_pipeline.downstream.record_labels import labelled


class MappedIndex:
    """The index of the units' sentences: `units` yields per unit (ids, offsets (n+1,), doc ids, sentence indices);
    `labels` / `label_key`: as ElmoDataset (unlabelled sentences left out, counted in `unlabelled`)."""

    def __init__(self, units: Iterable[tuple[pa.Array, np.ndarray, pa.Array, np.ndarray]],
                 labels: Mapping[str, Any] | None = None, label_key: str = "label"):
        ids, doc_ids, sidx, starts, lengths, firsts = [], [], [], [], [], [0]
        for sid, offsets, docs, indices in units:
            ids.append(pa.concat_arrays([sid]))                          # a copy: the map may go, the ids stay
            doc_ids.append(docs)
            sidx.append(indices)
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets).astype(np.int32))
            firsts.append(firsts[-1] + len(sid))
        self.ids, self.doc_ids, self.sentence_indices = ids, doc_ids, sidx
        self.unit_first = np.asarray(firsts, dtype=np.int64)          # (U+1,) first position of each unit
        self.firsts = firsts                                            # the same, a list (bisect)
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)          # (P,) token offsets
        self.all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)   # (P,) tokens
        self.keep, self.labels = None, None                             # positions of labelled sentences, labels
        if labels is not None:
            keep, self.labels = labelled(map(self.meta, range(len(self.all_lengths))), labels, label_key)
            self.keep = np.asarray(keep, dtype=np.int64)
        self.unlabelled = 0 if self.keep is None else len(self.all_lengths) - len(self.keep)
        self.lengths = self.all_lengths if self.keep is None else self.all_lengths[self.keep]   # (len,) tokens
        self.id_table: IdTable | None = None                            # built by the first id lookup

    def nbytes(self) -> int:
        """Bytes in memory (offsets, lengths, ids, doc ids, labels kept, the id hash table once built)."""
        n = self.starts.nbytes + self.all_lengths.nbytes + self.unit_first.nbytes + \
            sum(a.nbytes for a in self.sentence_indices) + sum(a.nbytes for a in self.doc_ids) + \
            sum(a.nbytes for a in self.ids) + (self.id_table.nbytes if self.id_table is not None else 0)
        return n + (self.keep.nbytes if self.keep is not None else 0)

    def global_position(self, i: int) -> int:
        """The global position of dataset position i (negative from the end); IndexError out of range."""
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"position {i} out of range ({n} sentences)")
        i = i % n
        return int(self.keep[i]) if self.keep is not None else i

    def global_positions(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(dataset positions, global positions), (B,) int64 each, of `positions` (negative ones from the end);
        IndexError naming the first out of range."""
        i = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = len(self.lengths)
        bad = (i < -n) | (i >= n)
        if bad.any():
            raise IndexError(f"position {int(i[bad][0])} out of range ({n} sentences)")
        i = i % n if n else i
        return i, (self.keep[i] if self.keep is not None else i)

    def unit(self, p: int) -> tuple[int, int]:
        """(unit, sentence within it) of global position p."""
        u = bisect.bisect_right(self.firsts, p) - 1
        return u, p - self.firsts[u]

    def units_of(self, pos: np.ndarray) -> np.ndarray:
        """The unit of each global position of `pos`."""
        return np.searchsorted(self.unit_first, pos, side="right") - 1

    def meta(self, p: int, where: tuple[int, int] | None = None) -> dict:
        """id, doc_id and sentence_index of global position p (`where`: its unit(p), when known)."""
        u, s = where or self.unit(p)
        return {"id": self.ids[u][s].as_py(), "doc_id": self.doc_ids[u][s].as_py(),
                "sentence_index": int(self.sentence_indices[u][s])}

    def position(self, sentence_id: str) -> int:
        """The dataset position of a sentence id; KeyError if absent. A binary search in the sorted 64-bit
        hashes of all ids (built on the first call), each hit checked against the id."""
        if self.id_table is None:
            self.id_table = IdTable(self.ids, self.firsts)
        p = self.id_table.find(sentence_id.encode())
        if p is None:
            raise KeyError(sentence_id)
        if self.keep is None:
            return p
        k = int(np.searchsorted(self.keep, p))
        if k < len(self.keep) and self.keep[k] == p:
            return k
        raise KeyError(sentence_id)
