"""Token-encoder outputs kept across batches (inference), so frequent words skip the char CNN."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from elmo_pipeline.model.device import host_side


class TokenCache:
    """Token-encoder outputs by token (its char-id row), so frequent words skip the char CNN.
    Looked up on the host (lookup, from the host's char ids), filled on the device (assemble)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.vectors: dict[bytes, Tensor] = {}
        self.params_key = None

    def lookup(self, uniq: Tensor, encoder: nn.Module, batch_invariant: bool = False
               ) -> tuple[list[bytes], list[int], list[int]]:
        """uniq (U, ...) host token inputs -> (keys, missing, hits): positions in uniq not cached / cached.
        The vectors of one batch_invariant setting are never served to the other (they may differ in the
        last bits): switching forgets the cache; so do changed weights."""
        key = (batch_invariant, *((p.data_ptr(), p._version) for p in encoder.parameters()))
        if key != self.params_key:          # weights changed: forget everything
            self.vectors, self.params_key = {}, key
        with host_side():
            keys = [row.tobytes() for row in uniq.to("cpu", torch.int16).numpy()]
        missing = [i for i, k in enumerate(keys) if k not in self.vectors]
        hits = [i for i, k in enumerate(keys) if k in self.vectors] if len(missing) < len(keys) else []
        return keys, missing, hits

    def assemble(self, keys: list[bytes], missing: list[int], hits: list[int], new_inputs: Tensor,
                 missing_at: Tensor | None, hits_at: Tensor | None, encoder: nn.Module,
                 batch_invariant: bool = False) -> Tensor:
        """(U, P) vectors of lookup()'s tokens: the cached ones, and the missing ones (new_inputs: their inputs,
        on the device) through the encoder; keeps new ones while there is room. missing_at / hits_at: the
        positions of missing / hits on the device (None when all are missing)."""
        new = encoder(new_inputs, batch_invariant) if missing else None
        if not hits:
            out = new
        else:
            cached = torch.stack([self.vectors[keys[i]] for i in hits])
            out = cached.new_empty(len(keys), cached.shape[1])
            out.index_copy_(0, hits_at, cached)
            if missing:
                out.index_copy_(0, missing_at, new)
        room = max(0, self.max_tokens - len(self.vectors))
        if missing and room:
            kept = new[:room].clone()              # one copy for all kept rows; entries are views of it
            for j, i in enumerate(missing[:room]):
                self.vectors[keys[i]] = kept[j]
        return out
