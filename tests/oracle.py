"""A plain, obviously-correct biLM forward pass: the specification that model/'s fast paths are tested against.

One sentence at a time, one token at a time, straight from the parameters (nothing of model/'s code runs):
  token vector   char CNN (bilm-tf): embed chars, per filter width a max over positions of the convolution,
                 activation, highway layers, a projection when the widths differ; or a word-embedding row
  LSTM step      TF's LSTMCell: concat([x, h]) @ W_0 + B, gates i, j, f, o, forget bias +1 at run time,
                 cell clip, projection, projection clip; a skip connection around every layer but the first
  output         layer 0 = [token, token]; layer k = [forward_k, backward_k] (backward runs right to left)
Slow by design; use it only to check the fast paths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from elmo_pipeline.model.bilm import BiLM


def _token_vector(model: BiLM, ids: Tensor) -> Tensor:
    """One token -> its vector (P,). ids: (C,) char ids (+1 shifted, 0 = padding) or () a word id."""
    enc, cc = model.token_encoder, model.opts.char_cnn
    if cc is None:
        return enc.embedding.weight[ids]                                 # (P,)
    act = torch.tanh if cc.get("activation", "relu") == "tanh" else F.relu
    x = enc.char_embed.weight[ids]                                       # (C, E), row 0 = zeros
    filters = []
    for conv in enc.convs:                                               # weight (n, E, w), bias (n,)
        windows = x.unfold(0, conv.weight.shape[2], 1)                   # (C - w + 1, E, w)
        filters.append(act((torch.einsum("pew,new->pn", windows, conv.weight) + conv.bias).amax(0)))   # (n,)
    h = torch.cat(filters)                                               # (F,)
    for hw in enc.highways:                                              # linear rows [:F] transform, [F:] carry
        w_t, w_c = hw.linear.weight.chunk(2)
        b_t, b_c = hw.linear.bias.chunk(2)
        t = torch.sigmoid(w_c @ h + b_c)
        h = t * torch.relu(w_t @ h + b_t) + (1 - t) * h
    return enc.proj.weight @ h + enc.proj.bias if enc.proj is not None else h      # (P,)


def _cell(layer, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One TF LSTMCell step for a single sentence: x (D,), h (P,), c (H,) -> h' (P,), c' (H,)."""
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
    """Same contract as BiLM.forward: inputs (B, T, C) char ids or (B, T) word ids, lengths (B,), state (h, c)
    with h (2, L, B, P), c (2, L, B, H) or None (zeros) -> layers (L+1, B, T, 2P) (zeros at padded positions)
    and each row's final (h, c)."""
    o = model.opts
    B, T = inputs.shape[:2]
    L, P = o.n_layers, o.projection_dim
    if state is None:
        state = model.zero_state(B)
    h_all, c_all = (s.clone() for s in state)
    out = torch.zeros(L + 1, B, T, 2 * P)
    for b in range(B):
        n = int(lengths[b])
        tokens = torch.stack([_token_vector(model, inputs[b, t]) for t in range(n)]) if n else torch.zeros(0, P)
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
