"""The elements that flow between the pipeline's stages. No Beam import.

Document (ReadFiles -> Tokenize), Blank (counted by ReadFiles), Item (a tokenized sentence: Tokenize ->
SortAndBatch -> Embed), Row (an embedded sentence: Embed -> WriteShards). Dead letters and staged-shard
descriptions are part of the output format (formats.layout.DeadLetter, ShardInfo).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Document:
    """A document's id and text; `split_sentences` False means the record is one sentence."""
    doc_id: str
    text: str
    split_sentences: bool = True


@dataclass(frozen=True)
class Blank:
    """A blank or whitespace-only record (str.isspace): counted in the manifest, not a document, not a dead letter."""
    id: str


@dataclass(frozen=True)
class Item:
    """A tokenized sentence: id "<doc_id>#<index>", its document, index, tokens and [start, end) offsets."""
    id: str
    doc_id: str
    index: int
    tokens: tuple[str, ...]
    offsets: tuple[tuple[int, int], ...]


@dataclass
class Row:
    """One embedded sentence: the item, Parquet column arrays [(T, D_k)], HDF5 array (AllenNLP layout)."""
    item: Item
    columns: list[np.ndarray]
    h5: np.ndarray | None = None
