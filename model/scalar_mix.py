"""Scalar mix of biLM layers: gamma * sum_k softmax(w)_k * layer_k (Peters et al. 2018, eq. 1)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


class ScalarMix(nn.Module):
    """Mix (L, ..., T, D) layers into (..., T, D).

    trainable: learn w and gamma (False: frozen, e.g. uniform or given weights).
    layer_norm: normalize each layer before mixing, over each sentence's own valid tokens and
    features. (AllenNLP normalizes over the whole padded batch, which makes a sentence's result
    depend on its batch; this one does not.) The mask (..., T) marks valid tokens.
    """

    def __init__(self, n_layers: int, trainable: bool = True, layer_norm: bool = False,
                 initial_weights: Sequence[float] | None = None, gamma: float = 1.0):
        super().__init__()
        w = torch.zeros(n_layers) if initial_weights is None else torch.tensor(list(initial_weights), dtype=torch.float32)
        if w.numel() != n_layers:
            raise ValueError(f"initial_weights has {w.numel()} values for {n_layers} layers")
        self.weights = nn.Parameter(w, requires_grad=trainable)
        self.gamma = nn.Parameter(torch.tensor(float(gamma)), requires_grad=trainable)
        self.layer_norm = layer_norm
        self.n_layers = n_layers

    def forward(self, layers: Tensor | Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        x = layers if isinstance(layers, Tensor) else torch.stack(list(layers))
        if x.shape[0] != self.n_layers:
            raise ValueError(f"expected {self.n_layers} layers, got {x.shape[0]}")
        if self.layer_norm:
            x = self._normalize(x, mask)
        w = torch.softmax(self.weights, dim=0).to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
        return self.gamma * (w * x).sum(dim=0)

    @staticmethod
    def _normalize(x: Tensor, mask: Tensor | None, eps: float = 1e-12) -> Tensor:
        m = torch.ones(x.shape[1:-1], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
        m = m.unsqueeze(-1).unsqueeze(0)                              # (1, ..., T, 1)
        n = (m.sum(dim=-2, keepdim=True) * x.shape[-1]).clamp_min(1)  # valid values per sentence
        mean = (x * m).sum(dim=(-2, -1), keepdim=True) / n
        var = (((x - mean) * m) ** 2).sum(dim=(-2, -1), keepdim=True) / n
        return (x - mean) / torch.sqrt(var + eps) * m
