"""--dedupe: the sentences of one run that share a sentence key (model.resolve.ModelSpec.sentence_key: the same
tokens under the same model and vector settings) are embedded once and written for every occurrence. No Beam
import; the graph groups Items by key (pipeline/graph.py), so each key is embedded once in the whole run.

one_of_each: a key's Items -> the one embedded (the smallest id), carrying the others as `copies`.
with_copies: an embedded batch -> the same with each item's copies after its items, their vectors repeated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from elmo_pipeline.transforms.records import EmbeddedBatch, Item


def one_of_each(items: Iterable[Item]) -> Item:
    """The Item of smallest id, with the others (sorted by id) as its copies."""
    first, *rest = sorted(items, key=lambda i: i.id)
    return dataclasses.replace(first, copies=tuple(rest)) if rest else first


def with_copies(batch: EmbeddedBatch) -> EmbeddedBatch:
    """`batch` with every item's copies appended after its items (copies count them), each copy's vectors those
    of its item; the items lose their `copies`."""
    extra = [(b, c) for b, item in enumerate(batch.items) for c in item.copies]
    if not extra:
        return batch
    rows = np.concatenate([np.arange(batch.offsets[-1]),
                           *(np.arange(batch.offsets[b], batch.offsets[b + 1]) for b, _ in extra)])
    lengths = np.diff(batch.offsets)
    offsets = np.concatenate([batch.offsets, batch.offsets[-1] + np.cumsum([lengths[b] for b, _ in extra])])
    items = [dataclasses.replace(i, copies=()) if i.copies else i for i in batch.items]
    return dataclasses.replace(batch, items=items + [c for _, c in extra], vectors=batch.vectors[:, rows],
                               offsets=offsets.astype(np.int64), copies=batch.copies + len(extra))


def occurrences(item: Item) -> list[Item]:
    """The item and its copies: what its dead letter or its progress accounts for."""
    return [item, *item.copies]
