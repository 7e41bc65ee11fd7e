"""One split of the probe's data (records with their layers and labels) and its batches.

A record is a dict with "layers" (L, T, D) float32 (L biLM layers, T tokens, D features) and an int
"label" (sentence task) or a list of T int "tags" (token task). Batches are (layers, mask, targets):
  pooled   (B, L, 1, D) per-layer means over each sentence's tokens, mask (B, 1), targets (B,)
  tokens   (B, L, 1, D) single tokens, mask (B, 1), targets (B,)
  padded   (B, L, T, D) whole sentences zero-padded to the batch's longest, mask (B, T), targets (B,)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from elmo_pipeline.downstream.batching import Batcher

@dataclass
class Split:
    """Records of one split (dicts with "layers" (L, T, D) float32 and an int "label" or "tags")."""
    name: str
    records: list
    pooled: torch.Tensor | None = None     # (N, L, D): per-layer mean over tokens, for linear settings
    tokens: torch.Tensor | None = None     # (Ntok, L, D): all tokens, for the tagger
    targets: torch.Tensor | None = None    # (N,) or (Ntok,)

    def token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer and feature mean and std over all tokens: (L, D) each."""
        n, s1, s2 = 0, 0.0, 0.0
        for r in self.records:
            x = r["layers"].astype(np.float64)
            n, s1, s2 = n + x.shape[1], s1 + x.sum(1), s2 + (x * x).sum(1)
        mean = s1 / max(n, 1)
        std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 0)) + 1e-5
        return torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)

    def prepare(self, task: str) -> "Split":
        if task == "sentence":
            self.pooled = torch.stack([torch.from_numpy(r["layers"].mean(1)) if r["layers"].shape[1]
                                       else torch.zeros(r["layers"].shape[0], r["layers"].shape[2]) for r in self.records])
            self.targets = torch.tensor([r["label"] for r in self.records], dtype=torch.int64)
        else:
            self.tokens = torch.from_numpy(np.concatenate([r["layers"].transpose(1, 0, 2) for r in self.records]))
            self.targets = torch.tensor([t for r in self.records for t in r["tags"]], dtype=torch.int64)
        return self


def _padded(records: list) -> tuple[torch.Tensor, torch.Tensor]:
    return Batcher(records[0]["layers"].shape[2]).from_sentences([list(r["layers"]) for r in records])


def batches(split: Split, mode: str, batch_size: int, order: np.ndarray):
    """(layers, mask, targets) batches in `order`. mode: pooled | padded | tokens."""
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        if mode == "pooled":
            x = split.pooled[idx].unsqueeze(2)                   # (B, L, 1, D)
            yield x, torch.ones(len(idx), 1, dtype=torch.bool), split.targets[idx]
        elif mode == "tokens":
            x = split.tokens[idx].unsqueeze(2)                   # (B, L, 1, D)
            yield x, torch.ones(len(idx), 1, dtype=torch.bool), split.targets[idx]
        else:
            recs = [split.records[i] for i in idx]
            x, mask = _padded(recs)
            yield x, mask, torch.tensor([r["label"] for r in recs], dtype=torch.int64)


def n_rows(split: Split, mode: str) -> int:
    """How many rows `batches` draws from: tokens (mode tokens) or sentences."""
    return len(split.targets) if mode == "tokens" else len(split.records)
