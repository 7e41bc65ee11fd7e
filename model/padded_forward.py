"""The biLM over a padded (B, T) batch: the forward pass under autograd (training, BiLM.forward with grad).

Same parameters and the same per-token math as BiLM.forward's packed inference path (model/bilm.py), laid out
for autograd: the time loop runs over (B, T) padded rows (each sequence reversed within its length for the
backward direction, so padding always comes after a sequence's tokens and cannot reach its outputs), and
per-step inputs come from one unbind instead of packed slices. The packed, in-place path is best for
inference; its many slices make backward passes slow. Results agree with it to float rounding
(tests/test_train.py and tests/test_oracle.py check it).

top_layer: the training forward pass (top layer of each direction, zero state).
padded_forward: BiLM.forward's full contract (every layer, zeros at padded positions, states in and out).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from elmo_pipeline.model.device import host_side, upload
from elmo_pipeline.model.lstm import LstmProjection
from elmo_pipeline.model.options import BiLMOptions


class BiLM(Protocol):
    """What these functions read of a model.bilm.BiLM (which imports this module: no import back)."""
    opts: BiLMOptions
    dropout: float
    training: bool
    forward_layers: Sequence[LstmProjection]
    backward_layers: Sequence[LstmProjection]

    def encode_tokens(self, inputs: Tensor, batch_invariant: bool = False) -> Tensor: ...


def _run_layer(layer: LstmProjection, x: Tensor, state: tuple[Tensor, Tensor] | None = None,
               lengths: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """x (T, B, D_in) time-major; state (h0 (B, P), c0 (B, H)), None for zeros -> outputs (T, B, P) and,
    given lengths (B,), each row's (h, c) after its last token (its initial state for length 0)."""
    T, B, _ = x.shape
    xw = torch.addmm(layer.bias + layer.forget_bias, x.reshape(T * B, -1), layer.w_in.t()).view(T, B, -1)
    w_rec_t, w_proj_t = layer.w_rec.t(), layer.w_proj.t()
    H = layer.dim
    h0, c0 = state if state is not None else (x.new_zeros(B, layer.proj_dim), x.new_zeros(B, H))
    h, c = h0, c0
    outs, cells = [], []
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
        if lengths is not None:
            cells.append(c)
    y = torch.stack(outs) if outs else x.new_zeros(0, B, layer.proj_dim)
    if lengths is None:
        return y, None
    last = lengths.to(x.device, torch.int64)[None, :, None]      # index into [initial state, step 0, ...]
    h_last = torch.cat([h0[None], y]).gather(0, last.expand(1, B, layer.proj_dim))[0]
    c_last = torch.stack([c0, *cells]).gather(0, last.expand(1, B, H))[0]
    return y, (h_last, c_last)


def reverse_index(lengths: Tensor, T: int) -> Tensor:
    """(B, T) index: row b reversed within its length, positions past it kept in place."""
    t = torch.arange(T)[None, :]
    L = lengths.to("cpu", torch.int64)[:, None]
    return torch.where(t < L, L - 1 - t, t)


def _token_vectors(bilm: BiLM, inputs: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> token vectors (B, T, P) with zeros at padded positions, the (B, T) mask of real positions and
    the (B, T, P) gather index that reverses each row within its length."""
    B, T = inputs.shape[:2]
    with host_side():                     # index maps from the host's lengths, sent in one copy
        lengths = torch.as_tensor(lengths).to("cpu", torch.int64)
        mask = torch.arange(T)[None, :] < lengths[:, None]
        host = {"at": mask.reshape(-1).nonzero().squeeze(1), "rev": reverse_index(lengths, T), "mask": mask}
    dev = upload(host, inputs.device)
    at, mask = dev["at"], dev["mask"].bool() if inputs.device.type != "cpu" else mask
    flat = inputs.reshape(B * T, *inputs.shape[2:]).index_select(0, at)
    emb = bilm.encode_tokens(flat)                                        # (N, P)
    P = emb.shape[-1]
    x = emb.new_zeros(B * T, P).index_copy(0, at, emb).view(B, T, P)
    rev = dev["rev"][:, :, None].expand(-1, -1, P)
    return x, mask, rev


def _directions(bilm: BiLM, x: Tensor, rev: Tensor, lengths: Tensor | None, state, top_only: bool):
    """Both directions' LSTM stacks over x (B, T, P). Per direction: the layers' outputs (B, T, P) in the
    batch's own time order (only the top one when top_only) and, given lengths, each layer's final (h, c).
    Dropout as BiLM applies it (on every LSTM layer's input) when bilm.training."""
    outs, finals = [], []
    for d, stack in enumerate((bilm.forward_layers, bilm.backward_layers)):
        h = x if d == 0 else x.gather(1, rev)
        h = h.transpose(0, 1)                                             # (T, B, P)
        ys, last = [], []
        for k, layer in enumerate(stack):
            inp = F.dropout(h, bilm.dropout, bilm.training) if bilm.dropout else h
            y, hc = _run_layer(layer, inp, None if state is None else (state[0][d, k], state[1][d, k]), lengths)
            last.append(hc)
            if bilm.opts.use_skip_connections and k > 0:
                y = y + h
            h = y
            if not top_only or k == len(stack) - 1:
                ys.append(y)
        ys = [y.transpose(0, 1) for y in ys]                              # (B, T, P)
        outs.append(ys if d == 0 else [y.gather(1, rev) for y in ys])
        finals.append(last)
    return outs, finals


def top_layer(bilm: BiLM, inputs: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """inputs (B, T, max_chars) or (B, T) ids, lengths (B,) -> forward and backward top-layer outputs,
    each (B, T, P), valid at positions < length (anything at padded positions), from zero state."""
    x, _, rev = _token_vectors(bilm, inputs, lengths)
    (fwd, bwd), _ = _directions(bilm, x, rev, None, None, top_only=True)
    return fwd[0], bwd[0]


def padded_forward(bilm: BiLM, inputs: Tensor, lengths: Tensor, state: tuple[Tensor, Tensor] | None = None):
    """BiLM.forward's contract (see BiLM): layers (n_layers + 1, B, T, 2P), zeros at padded positions, and
    the final state (h (2, n_layers, B, P), c (2, n_layers, B, H)) in batch-row order; state None is zeros."""
    x, mask, rev = _token_vectors(bilm, inputs, lengths)
    (fwd, bwd), (fin_f, fin_b) = _directions(bilm, x, rev, lengths, state, top_only=False)
    keep = mask[..., None]
    layers = [torch.cat([x, x], dim=-1)] + [torch.where(keep, torch.cat([f, b], dim=-1), 0.0)
                                            for f, b in zip(fwd, bwd)]
    h = torch.stack([torch.stack([hc[0] for hc in fin]) for fin in (fin_f, fin_b)])   # (2, L, B, P)
    c = torch.stack([torch.stack([hc[1] for hc in fin]) for fin in (fin_f, fin_b)])   # (2, L, B, H)
    return torch.stack(layers), (h, c)
