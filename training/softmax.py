"""The language-model softmax shared by the forward and backward LMs (not part of the inference weights).

Two kinds, chosen in options.json under "softmax":
  {"type": "full"}                                        a (V, P) output layer: fine for small vocabularies
  {"type": "adaptive", "cutoffs": [2000, 10000], "div_value": 4.0}
        Grave et al.'s adaptive softmax (torch.nn.AdaptiveLogSoftmaxWithLoss): frequent words in a full
        head, rare words in smaller clusters. Exact normalised probabilities (so perplexities are exact)
        at a fraction of the cost. Needs the vocabulary sorted by frequency (training/data.py does).
Both expose nll(hidden (N, P), targets (N,)) -> (N,) negative log-likelihoods in nats.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FullSoftmax(nn.Module):
    def __init__(self, dim: int, n_classes: int):
        super().__init__()
        self.out = nn.Linear(dim, n_classes)
        nn.init.normal_(self.out.weight, std=dim ** -0.5)
        nn.init.zeros_(self.out.bias)

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(self.out(hidden), targets, reduction="none")

    def log_prob(self, hidden: Tensor) -> Tensor:  # (N, P) -> (N, V)
        return F.log_softmax(self.out(hidden), dim=-1)


class AdaptiveSoftmax(nn.Module):
    def __init__(self, dim: int, n_classes: int, cutoffs: list[int], div_value: float = 4.0):
        super().__init__()
        cutoffs = [int(c) for c in cutoffs if 0 < int(c) < n_classes - 1]
        self.ada = nn.AdaptiveLogSoftmaxWithLoss(dim, n_classes, cutoffs, div_value=div_value)

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        if hidden.shape[0] == 0:
            return hidden.new_zeros(0)
        return -self.ada(hidden, targets).output

    def log_prob(self, hidden: Tensor) -> Tensor:
        return self.ada.log_prob(hidden)


def build_softmax(spec: dict | None, dim: int, n_classes: int) -> nn.Module:
    """The softmax of options.json's "softmax" entry (default: adaptive above 5000 words, else full)."""
    spec = dict(spec or {})
    kind = spec.get("type") or ("adaptive" if n_classes > 5000 else "full")
    if kind == "full":
        return FullSoftmax(dim, n_classes)
    if kind == "adaptive":
        cutoffs = spec.get("cutoffs") or [c for c in (2000, 10000, 50000) if c < n_classes - 1]
        if not cutoffs:
            return FullSoftmax(dim, n_classes)
        return AdaptiveSoftmax(dim, n_classes, cutoffs, float(spec.get("div_value", 4.0)))
    raise ValueError(f"options.json: softmax.type should be 'full' or 'adaptive', found {kind!r}")
