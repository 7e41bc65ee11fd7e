"""Items through the embedder as EmbeddedBatches: the plain part of the embedding step. No Beam import.

A batch's sentences up to the window (window_limit) are embedded as one batch by the step itself (it may
run them on a thread); those over it are embedded as overlapping windows (model/windows.py), all of a
batch's together; a sentence of a part that failed is embedded alone (embed_alone) or dead-lettered.
"""
from __future__ import annotations

import numpy as np

from elmo_pipeline.formats.layout import EXCERPT_CHARS, DeadLetter
from elmo_pipeline.model.windows import effective_window, embed_long, embed_long_many
from elmo_pipeline.transforms.records import EmbeddedBatch, Item


def window_limit(window: int, max_tokens: int) -> int | None:
    """The longest sentence embedded whole (the budget-capped window); None: no windows (window 0)."""
    return effective_window(window, max_tokens) if window else None


def split_at_window(batch: list[Item], limit: int | None) -> tuple[list[Item], list[Item]]:
    """(the items of at most `limit` tokens, those over it), each in batch order; limit None: all are short."""
    return ([i for i in batch if limit is None or len(i.tokens) <= limit],
            [i for i in batch if limit is not None and len(i.tokens) > limit])


def embed_alone(embedder, item: Item, window: int, overlap: int, max_tokens: int,
                layers: tuple[int, ...] | None) -> EmbeddedBatch:
    """One item as a batch of its own: in windows when it is over window_limit, else whole (only `layers`)."""
    limit = window_limit(window, max_tokens)
    if limit is not None and len(item.tokens) > limit:
        vectors = embed_long(embedder, item.tokens, window, overlap, max_tokens)
        return EmbeddedBatch([item], vectors, np.array([0, len(item.tokens)], dtype=np.int64))
    return EmbeddedBatch([item], *embedder.embed_packed([item.tokens], layers), layers)


def embed_windowed(embedder, items: list[Item], window: int, overlap: int, max_tokens: int
                   ) -> list[EmbeddedBatch]:
    """One EmbeddedBatch per item, the windows of all of them sharing sub-batches (model.windows.embed_long_many)."""
    vectors = embed_long_many(embedder, [i.tokens for i in items], window, overlap, max_tokens)
    return [EmbeddedBatch([i], v, np.array([0, len(i.tokens)], dtype=np.int64)) for i, v in zip(items, vectors)]


def embedding_failed(item: Item, error: Exception) -> DeadLetter:
    """The dead letter of a sentence that failed even embedded alone."""
    return DeadLetter(item.id, f"embedding failed: {type(error).__name__}: {error}"[:500],
                      " ".join(item.tokens)[:EXCERPT_CHARS])
