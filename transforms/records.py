"""The elements that flow between the pipeline's stages. No Beam import.

Document (ReadFiles -> Tokenize), Blank (counted by ReadFiles), Item (a tokenized sentence: Tokenize ->
SortAndBatch -> EmbedBatches), EmbeddedBatch (a batch of embedded sentences, columnar: EmbedBatches ->
WriteShards).
Dead letters and staged-shard descriptions are part of the output format (formats.layout). Their Beam coders
are in transforms/coders.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_DOCUMENT_TOKENS = 1_000_000     # --max-document-tokens default: a document with more is one dead letter


@dataclass(frozen=True)
class Document:
    """A document's id and text; `split_sentences` False means the record is one sentence. `source` is
    "<file>:<line or row>" when the id comes from an --id-field (to name duplicates), else "". `nbytes`: its
    share of the input file's bytes on disk (progress by input bytes only; not content, not compared)."""
    doc_id: str
    text: str
    split_sentences: bool = True
    source: str = ""
    nbytes: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Blank:
    """A blank or whitespace-only record (str.isspace): counted in the manifest, not a document, not a dead letter."""
    id: str


@dataclass(frozen=True)
class Item:
    """A tokenized sentence: id "<doc_id>#<index>", its document, index, tokens and [start, end) offsets;
    `nbytes` its share of its document's input bytes (progress only; not compared). `copies`: with --dedupe,
    the other sentences of its sentence key, written with its vectors (transforms/dedupe.py). `key`: its sentence
    key (model.resolve.sentence_key), computed once where it is tokenized when the run keys its sentences, and
    carried to --dedupe, --reuse and the key index ('' when not keyed; a function of the tokens: not compared)."""
    id: str
    doc_id: str
    index: int
    tokens: tuple[str, ...]
    offsets: tuple[tuple[int, int], ...]
    nbytes: int = field(default=0, compare=False)
    copies: tuple["Item", ...] = ()
    key: str = field(default="", compare=False)


@dataclass
class EmbeddedBatch:
    """Embedded sentences, columnar: the embedder's packed output as it is, never a Python object or an array
    per sentence. vectors float32 (L+1, N, 2P) (layer 0 duplicated [x, x]), or (len(layers), N, 2P) when only
    `layers` (ascending) were copied out of the model; sentence b of `items` is vectors[:, offsets[b]:offsets[b+1]];
    offsets (B+1,) int64. The last `copies` items are copies (--dedupe): written with another item's vectors.
    `source`: the vectors were read from this --reuse source (its redacted URL: transforms/reuse.py), not embedded.
    `kernel`: the kernel path of the process that embedded them (model/kernels.py kernel_path, as canonical JSON:
    transforms.embed.LoadedModel.kernel); None when read from a source, or not recorded."""
    items: list[Item]
    vectors: np.ndarray
    offsets: np.ndarray
    layers: tuple[int, ...] | None = None
    copies: int = 0
    source: str | None = None
    kernel: str | None = None

    def tokens(self, b: int) -> int:
        return int(self.offsets[b + 1] - self.offsets[b])
