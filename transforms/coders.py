"""Beam coders for the elements that cross a stage boundary, registered on import (pipeline.graph imports this
module before building the graph; runners ship the coders with the pipeline, so workers import it too).

Explicit and deterministic, so every runner that encodes elements between stages (Dataflow, Flink, Spark,
FnApiRunner with several workers) gets back exactly the objects it was given, with no pickle: Document,
Item, EmbeddedBatch (float32 vectors bit for bit), DeadLetter, ShardInfo. Built from Beam's own component
coders; PCollections are typed in pipeline.graph.build() so that the registry finds them.
"""
from __future__ import annotations

import json

import numpy as np
from apache_beam import coders

from elmo_pipeline.formats.layout import DeadLetter, ShardInfo
from elmo_pipeline.transforms.records import Document, EmbeddedBatch, Item

_STR, _INT, _BYTES, _BOOL = coders.StrUtf8Coder(), coders.VarIntCoder(), coders.BytesCoder(), coders.BooleanCoder()


class _TupleBacked(coders.Coder):
    """A coder of a record type through a TupleCoder of its fields' coders (to_tuple / from_tuple)."""
    components: tuple[coders.Coder, ...] = ()

    def __init__(self):
        self._tuple = coders.TupleCoder(list(self.components))

    def encode(self, value) -> bytes:
        return self._tuple.encode(self.to_tuple(value))

    def decode(self, encoded: bytes):
        return self.from_tuple(self._tuple.decode(encoded))

    def is_deterministic(self) -> bool:
        return True

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


class DocumentCoder(_TupleBacked):
    components = (_STR, _STR, _BOOL, _STR, _INT)

    def to_tuple(self, d: Document):
        return d.doc_id, d.text, d.split_sentences, d.source, d.nbytes

    def from_tuple(self, t) -> Document:
        return Document(*t)


def _pairs(flat: bytes) -> tuple[tuple[int, int], ...]:
    a = np.frombuffer(flat, dtype="<i8").reshape(-1, 2)
    return tuple((int(s), int(e)) for s, e in a)


class ItemCoder(_TupleBacked):
    """Tokens as a list of UTF-8 strings, offsets as little-endian int64 pairs, copies as Items encoded alike."""
    components = (_STR, _STR, _INT, coders.ListCoder(_STR), _BYTES, _INT, coders.ListCoder(_BYTES), _STR)

    def to_tuple(self, i: Item):
        return (i.id, i.doc_id, i.index, list(i.tokens), np.asarray(i.offsets, dtype="<i8").reshape(-1, 2).tobytes(),
                i.nbytes, [self.encode(c) for c in i.copies], i.key)

    def from_tuple(self, t) -> Item:
        return Item(t[0], t[1], t[2], tuple(t[3]), _pairs(t[4]), t[5], tuple(self.decode(c) for c in t[6]), t[7])


class EmbeddedBatchCoder(_TupleBacked):
    """Items, then the vectors' shape and raw little-endian float32 bytes (exact), then the offsets, then the
    layers they hold ([] for all), then how many items are copies, then the --reuse source ("": embedded), then the
    kernel path that embedded them ("": not recorded)."""
    components = (coders.ListCoder(ItemCoder()), coders.ListCoder(_INT), _BYTES, _BYTES, coders.ListCoder(_INT), _INT,
                  _STR, _STR)

    def to_tuple(self, b: EmbeddedBatch):
        v = np.ascontiguousarray(b.vectors, dtype="<f4")
        return (list(b.items), list(v.shape), v.tobytes(), np.asarray(b.offsets, dtype="<i8").tobytes(),
                list(b.layers or ()), b.copies, b.source or "", b.kernel or "")

    def from_tuple(self, t) -> EmbeddedBatch:
        vectors = np.frombuffer(t[2], dtype="<f4").reshape(t[1]).astype(np.float32)   # a writable copy
        return EmbeddedBatch(t[0], vectors, np.frombuffer(t[3], dtype="<i8").astype(np.int64), tuple(t[4]) or None,
                             t[5], t[6] or None, t[7] or None)


class DeadLetterCoder(_TupleBacked):
    components = (_STR, _STR, _STR, _STR)

    def to_tuple(self, d: DeadLetter):
        return d.id, d.reason, d.excerpt, d.level

    def from_tuple(self, t) -> DeadLetter:
        return DeadLetter(*t)


class ShardInfoCoder(_TupleBacked):
    """A staged shard's description, as canonical JSON."""
    components = (_STR,)

    def to_tuple(self, s: ShardInfo):
        return (json.dumps([s.files, s.sentences, s.tokens, s.first_id, s.extra], sort_keys=True),)

    def from_tuple(self, t) -> ShardInfo:
        return ShardInfo(*json.loads(t[0]))


CODERS = {Document: DocumentCoder, Item: ItemCoder, EmbeddedBatch: EmbeddedBatchCoder, DeadLetter: DeadLetterCoder,
          ShardInfo: ShardInfoCoder}
for _type, _coder in CODERS.items():
    coders.registry.register_coder(_type, _coder)
