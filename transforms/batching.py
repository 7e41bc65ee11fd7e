"""Sentence items and batch accounting. No Beam import. The batch planner is model.batching.plan_batches:
a batch's cost is its padded size, n_sentences * (longest + 2) token slots (<S> and </S> included).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """A tokenized sentence: id "<doc_id>#<index>", its document, index, tokens and [start, end) offsets."""
    id: str
    doc_id: str
    index: int
    tokens: tuple[str, ...]
    offsets: tuple[tuple[int, int], ...]


def sentence_id(doc_id: str, index: int) -> str:
    return f"{doc_id}#{index}"


def padding(lengths: list[int]) -> tuple[int, int]:
    """(real tokens, padded token slots) of one batch of sentence lengths, without <S>/</S>."""
    return sum(lengths), len(lengths) * max(lengths, default=0)
