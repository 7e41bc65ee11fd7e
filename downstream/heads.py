"""The probe's classifiers: a layer combiner (downstream.combine) followed by a head.

Each takes layers (B, L, T, D) float32 and a mask (B, T) bool and returns logits:
  SentenceMLP     combine -> mean over the sentence's tokens -> MLP (one hidden layer)   (B, C)
  SentenceLinear  combine -> mean over the sentence's tokens -> linear                   (B, C)
  SentenceBiLSTM  combine -> BiLSTM -> max over tokens -> linear                         (B, C)
  TokenTagger     combine -> linear per token                                            (B, T, C)
LinearHead is the base of the two linear ones. Standardized wraps a combiner to z-score each layer's
features first.
"""
from __future__ import annotations

import torch
from torch import nn

from elmo_pipeline.downstream.combine import SelectLayer


class Standardized(nn.Module):
    """z-score each layer's features with training-set token statistics, then combine. Affine per
    feature, so it commutes with mean pooling (the pooled path stays exact)."""

    def __init__(self, combiner: nn.Module, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.combiner = combiner
        self.linear = combiner.linear
        self.register_buffer("mean", mean[:, None, :].clone())    # (L, 1, D)
        self.register_buffer("std", std[:, None, :].clone())

    def forward(self, layers: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.combiner, SelectLayer):      # the same result, one layer's work
            k = self.combiner.index
            return (layers[:, k] - self.mean[k]) / self.std[k]
        return self.combiner((layers - self.mean) / self.std, mask)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp_min(1)


class SentenceMLP(nn.Module):
    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, hidden: int = 256, dropout: float = 0.3):
        super().__init__()
        self.combiner = combiner
        self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, n_classes))

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.mlp(_masked_mean(self.combiner(layers, mask), mask))


class SentenceBiLSTM(nn.Module):
    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, hidden: int = 128, dropout: float = 0.3):
        super().__init__()
        self.combiner = combiner
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, n_classes)

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.combiner(layers, mask))
        lengths = mask.sum(1).clamp_min(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
        h = h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
        return self.out(self.drop(h))


class LinearHead(nn.Module):
    """combine -> dropout -> linear (dim -> n_classes): on a linear combination, a logistic regression (the
    probe fits these by L-BFGS). Subclasses choose the rows the linear layer reads."""

    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, dropout: float = 0.0):
        super().__init__()
        self.combiner = combiner
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, n_classes)


class SentenceLinear(LinearHead):
    """combine -> mean over the sentence's tokens -> linear: a logistic regression on the pooled mix."""

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(_masked_mean(self.combiner(layers, mask), mask)))


class TokenTagger(LinearHead):
    """combine -> linear per token."""

    def __init__(self, combiner: nn.Module, dim: int, n_classes: int, dropout: float = 0.3):
        super().__init__(combiner, dim, n_classes, dropout)

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.combiner(layers, mask)))   # (B, T, C)
