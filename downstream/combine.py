"""Combining biLM layers (B, L, T, D) into one vector per token (B, T, D). No Beam import.

Settings (`make_combiner(name, n_layers, dim)`; `expand_settings` turns the probe's --settings / --combine
into their names):
  layerK     layer K alone (layer0 = the non-contextual char-CNN token vector)
  trainable  scalar mix with trainable weights and scale: gamma * sum_k softmax(w)_k * layer_k
             (Peters et al. 2018, eq. 1), weights start uniform
  frozen     the same scalar mix with random weights drawn once from N(0, 1) (seeded) and gamma = 1,
             never trained
  learned    a learned function of all layers per token: a 2-layer MLP over the concatenated layers
             (L*D -> D -> D, GELU), trained with the classifier
All are per-token functions (no mixing across tokens or sentences), so a sentence's features never
depend on its batch. The scalar mixes and single layers are linear, which the probe uses to mean-pool
before mixing (same result, much less work).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from elmo_pipeline.model.scalar_mix import ScalarMix

MIXES = ("trainable", "frozen", "learned")


class SelectLayer(nn.Module):
    """One layer of the stack."""

    linear = True

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, layers: Tensor, mask: Tensor | None = None) -> Tensor:
        return layers[:, self.index]


class MixLayers(nn.Module):
    """Scalar mix over the layer axis of (B, L, T, D) (model.ScalarMix; trainable or frozen)."""

    linear = True

    def __init__(self, n_layers: int, trainable: bool = True, initial_weights=None, layer_norm: bool = False):
        super().__init__()
        self.mix = ScalarMix(n_layers, trainable=trainable, layer_norm=layer_norm, initial_weights=initial_weights)

    def forward(self, layers: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.mix(layers.transpose(0, 1), mask)

    def layer_weights(self) -> list[float]:
        return torch.softmax(self.mix.weights.detach(), 0).tolist()


class LearnedCombine(nn.Module):
    """A learned per-token function of all layers: MLP(concat_k layer_k), L*D -> hidden -> D."""

    linear = False

    def __init__(self, n_layers: int, dim: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = hidden or dim
        self.net = nn.Sequential(nn.Linear(n_layers * dim, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, dim))

    def forward(self, layers: Tensor, mask: Tensor | None = None) -> Tensor:
        B, L, T, D = layers.shape
        out = self.net(layers.permute(0, 2, 1, 3).reshape(B, T, L * D))
        return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)


def make_combiner(name: str, n_layers: int, dim: int, seed: int = 0) -> nn.Module:
    """'layer0' .. 'layer{L-1}', 'trainable', 'frozen', 'learned' (also 'mix-trainable', ...)."""
    name = name.removeprefix("mix-")
    m = re.fullmatch(r"layer_?(\d+)", name)
    if m:
        k = int(m.group(1))
        if not 0 <= k < n_layers:
            raise ValueError(f"{name}: layers are 0..{n_layers - 1}")
        return SelectLayer(k)
    if name == "trainable":
        return MixLayers(n_layers, trainable=True)
    if name == "frozen":
        g = torch.Generator().manual_seed(seed)
        return MixLayers(n_layers, trainable=False, initial_weights=torch.randn(n_layers, generator=g).tolist())
    if name == "learned":
        return LearnedCombine(n_layers, dim)
    raise ValueError(f"unknown layer setting {name!r}: layer<K>, trainable, frozen or learned")


def expand_settings(settings: Sequence[str], combine: Sequence[str], n_layers: int) -> list[str]:
    """'layers' -> layer0..layer{L-1}; 'mix' -> mix-<c> for each --combine c; others kept."""
    out = []
    for s in settings:
        s = s.strip()
        if s == "layers":
            out += [f"layer{k}" for k in range(n_layers)]
        elif s == "mix":
            out += [f"mix-{c}" for c in combine]
        elif s:
            out.append(s if s.startswith(("layer", "mix-")) else f"mix-{s}")
    for s in out:
        make_combiner(s, n_layers, 2)   # validates
    return list(dict.fromkeys(out))
