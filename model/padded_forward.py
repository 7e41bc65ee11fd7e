"""The BiLM's top-layer outputs computed over a padded batch: the training forward pass.

Same parameters and the same per-token math as BiLM.forward (model/bilm.py), from zero state, but laid
out for autograd: the time loop runs over (B, T) padded rows (each sequence reversed within its length
for the backward direction, so padding always comes after a sequence's tokens and cannot reach its
outputs), and per-step inputs come from one unbind instead of packed slices. BiLM.forward's packed
layout is best for inference; its many slices make backward passes slow. Results agree with
BiLM.forward to float rounding (tests/test_train.py checks it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.bilm import BiLM, LstmProjection


def _run_layer(layer: LstmProjection, x: Tensor) -> Tensor:
    """x (T, B, D_in) time-major -> outputs (T, B, P), from zero state."""
    T, B, _ = x.shape
    xw = torch.addmm(layer.bias + layer.forget_bias, x.reshape(T * B, -1), layer.w_in.t()).view(T, B, -1)
    w_rec_t, w_proj_t = layer.w_rec.t(), layer.w_proj.t()
    H = layer.dim
    h = x.new_zeros(B, layer.proj_dim)
    c = x.new_zeros(B, H)
    outs = []
    for xw_t in xw.unbind(0):
        gates = torch.addmm(xw_t, h, w_rec_t)
        i, j, f, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(j)
        if layer.cell_clip is not None:
            c = c.clamp(-layer.cell_clip, layer.cell_clip)
        h = (torch.sigmoid(o) * torch.tanh(c)).mm(w_proj_t)
        if layer.proj_clip is not None:
            h = h.clamp(-layer.proj_clip, layer.proj_clip)
        outs.append(h)
    return torch.stack(outs)


def reverse_index(lengths: Tensor, T: int) -> Tensor:
    """(B, T) index: row b reversed within its length, positions past it kept in place."""
    t = torch.arange(T)[None, :]
    L = lengths.to("cpu", torch.int64)[:, None]
    return torch.where(t < L, L - 1 - t, t)


def top_layer(bilm: BiLM, inputs: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """inputs (B, T, max_chars) or (B, T) ids, lengths (B,) -> forward and backward top-layer outputs,
    each (B, T, P), valid at positions < length (anything at padded positions). Dropout as BiLM applies it
    (on every LSTM layer's input) when bilm.training."""
    B, T = inputs.shape[:2]
    device = inputs.device
    mask = (torch.arange(T)[None, :] < lengths.to("cpu")[:, None]).to(device)
    flat = inputs.reshape(B * T, *inputs.shape[2:])[mask.reshape(-1)]
    emb = bilm.encode_tokens(flat)                                        # (N, P)
    P = emb.shape[-1]
    x = emb.new_zeros(B, T, P)
    x[mask] = emb
    rev = reverse_index(lengths, T).to(device)
    outs = []
    for d, stack in enumerate((bilm.forward_layers, bilm.backward_layers)):
        h = x if d == 0 else x.gather(1, rev[:, :, None].expand(-1, -1, P))
        h = h.transpose(0, 1)                                             # (T, B, P)
        for k, layer in enumerate(stack):
            inp = F.dropout(h, bilm.dropout, bilm.training) if bilm.dropout else h
            y = _run_layer(layer, inp)
            if bilm.opts.use_skip_connections and k > 0:
                y = y + h
            h = y
        h = h.transpose(0, 1)                                             # (B, T, P)
        outs.append(h if d == 0 else h.gather(1, rev[:, :, None].expand(-1, -1, P)))
    return outs[0], outs[1]
