"""A plain, obviously-correct biLM forward pass: the test oracle for model/bilm.py's fast path.

One sentence at a time, one token at a time, written as TF's LSTMCell computes it
(concat([x, h]) @ W_0 + B, gates i, j, f, o, forget bias +1 at run time). The char CNN runs on
every token. Slow by design; use it only to check the fast path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model.bilm import BiLM


def _cell(layer, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One TF LSTMCell step for a single sentence: x (D,), h (P,), c (H,)."""
    W0 = torch.cat([layer.w_in.t(), layer.w_rec.t()])       # (D + P, 4H): TF's kernel
    i, j, f, o = (torch.cat([x, h]) @ W0 + layer.bias).chunk(4)
    c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j)
    if layer.cell_clip is not None:
        c = c.clamp(-layer.cell_clip, layer.cell_clip)
    h = (torch.sigmoid(o) * torch.tanh(c)) @ layer.w_proj.t()
    if layer.proj_clip is not None:
        h = h.clamp(-layer.proj_clip, layer.proj_clip)
    return h, c


@torch.no_grad()
def oracle_forward(model: BiLM, inputs: Tensor, lengths: Tensor, state=None):
    """Same contract as BiLM.forward: returns (layers (L+1, B, T, 2P), (h, c))."""
    o = model.opts
    B, T = inputs.shape[:2]
    L, P = o.n_layers, o.projection_dim
    if state is None:
        state = model.zero_state(B)
    h_all, c_all = (s.clone() for s in state)
    out = torch.zeros(L + 1, B, T, 2 * P)
    for b in range(B):
        n = int(lengths[b])
        tokens = torch.stack([model.token_encoder(inputs[b, t: t + 1])[0] for t in range(n)]) if n else torch.zeros(0, P)
        out[0, b, :n] = torch.cat([tokens, tokens], dim=-1)
        for d, stack in enumerate((model.forward_layers, model.backward_layers)):
            steps = range(n) if d == 0 else range(n - 1, -1, -1)
            seq = tokens
            for k, layer in enumerate(stack):
                h, c = h_all[d, k, b], c_all[d, k, b]
                y = torch.zeros(n, P)
                for t in steps:
                    h, c = _cell(layer, seq[t], h, c)
                    y[t] = h + seq[t] if (o.use_skip_connections and k > 0) else h
                h_all[d, k, b], c_all[d, k, b] = h, c
                out[k + 1, b, :n, d * P:(d + 1) * P] = y
                seq = y
    return out, (h_all, c_all)
