"""Token encoders: a token's context-free vector, from its characters (CharCNNEncoder) or its id (WordEncoder).

bilm-tf's char CNN: char embedding -> Conv1d per filter width -> max over positions -> activation
-> highway layers -> a projection when the filter count differs from the LSTMs' width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo_pipeline.model import onednn
from elmo_pipeline.model.options import N_CHAR_ROWS, BiLMOptions
from elmo_pipeline.model.row_tile import ROW_TILE, in_pieces, round_up, row_rule_of


# Tokens per chunk of the char CNN's GEMMs: (512 * 44, 112) @ (112, 1024) for the widest filter of the
# published models, output about 90 MB whatever the number of distinct tokens. A multiple of ROW_TILE.
# On oneDNN, chunks of 64 tokens: the output, about 11 MB, stays in the cache for the max that follows (faster
# than chunks of 512 on an AMD EPYC Zen 5); on a GPU, bigger chunks mean fewer launches.
CNN_CHUNK = 512
CNN_CHUNK_ONEDNN = 64


def invariant_linear(linear: nn.Linear, x: Tensor, packed: Tensor | None) -> Tensor:
    """linear(x) for the batch-invariant path: x (N, in), N a multiple of ROW_TILE, on row counts this process
    checked for the GEMM (model/row_tile.py); on oneDNN with packed = onednn.pack(linear.weight), else torch's
    linear."""
    n_out, n_in = linear.weight.shape
    if packed is None:
        return in_pieces(linear, x, row_rule_of("linear", n_in, n_out, x.dtype))
    return in_pieces(lambda rows: onednn.linear(rows, packed, linear.bias), x,
                     row_rule_of("onednn", n_in, n_out, x.dtype, "none", "bias"))


class Highway(nn.Module):
    """y = t * relu(x @ W_transform + b_transform) + (1 - t) * x,  t = sigmoid(x @ W_carry + b_carry).

    bilm-tf's convention: its "carry" gate t weighs the transformed path. (AllenNLP flips the sign
    of W_carry/b_carry to use g * x + (1 - g) * f(x); we keep TF's form and its weights as they are.)
    The two linear maps are one GEMM: weight rows [:d] = transform, [d:] = carry.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, batch_invariant: bool = False, packed: Tensor | None = None) -> Tensor:
        """(N, d) -> (N, d). packed: self.linear's weight prepacked for oneDNN (onednn.pack), to run the GEMM there.
        batch_invariant: N a multiple of ROW_TILE, the GEMM on checked row counts (invariant_linear)."""
        z = invariant_linear(self.linear, x, packed) if batch_invariant else \
            self.linear(x) if packed is None else onednn.linear(x, packed, self.linear.bias)
        transform, carry = z.split(self.dim, dim=-1)
        # batch_invariant: a sigmoid whose result does not depend on where the element falls in the tensor
        # (torch.sigmoid's scalar tail differs from its vector body; exp(-x) + 1 -> reciprocal agrees)
        t = torch.exp(-carry).add_(1.0).reciprocal_() if batch_invariant else torch.sigmoid(carry)
        return t * F.relu(transform) + (1.0 - t) * x


class CharCNNEncoder(nn.Module):
    """Token vectors from character ids: (N, max_chars) int64 (+1 shifted, 0 = padding) -> (N, P).

    Under autograd the filters are nn.Conv1d; without, GEMMs over unfolded character windows (faster), in
    chunks of CNN_CHUNK tokens, every GEMM on oneDNN with prepacked weights where it runs the dtype
    (model/onednn.py; chunks of CNN_CHUNK_ONEDNN). batch_invariant (inference): the rows are padded to a multiple
    of ROW_TILE."""

    def __init__(self, opts: BiLMOptions):
        super().__init__()
        cc = opts.char_cnn
        char_dim = int(cc["embedding"]["dim"])
        self.char_embed = nn.Embedding(N_CHAR_ROWS, char_dim, padding_idx=0)
        # TF's conv2d over (1, width) with VALID padding is a plain cross-correlation: Conv1d.
        self.convs = nn.ModuleList(nn.Conv1d(char_dim, n, w) for w, n in opts.filters)
        self.activation = torch.tanh if cc.get("activation", "relu") == "tanh" else F.relu
        n_filters = opts.n_filters
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(int(cc.get("n_highway") or 0)))
        # bilm-tf projects only when the widths differ, after the highway layers.
        self.proj = nn.Linear(n_filters, opts.projection_dim) if n_filters != opts.projection_dim else None

    def forward(self, char_ids: Tensor, batch_invariant: bool = False) -> Tensor:
        if torch.is_grad_enabled():
            return self._highways(self._filters_by_conv(char_ids), False, None)
        w = self.char_embed.weight
        packed = self._packed() if onednn.runs(w.device, w.dtype) else None
        if not batch_invariant:
            return self._highways(self._filters_in_chunks(char_ids, packed), False, packed)
        # every GEMM below gets a multiple of ROW_TILE rows: pad with all-padding tokens (char id 0)
        n = char_ids.shape[0]
        pad = round_up(n, ROW_TILE) - n
        if pad:
            char_ids = torch.cat([char_ids, char_ids.new_zeros(pad, *char_ids.shape[1:])])
        return self._highways(self._filters_in_chunks(char_ids, packed, True), True, packed)[:n]

    def _packed(self) -> dict:
        """The GEMMs' weights prepacked for oneDNN, (out, in) each: 'convs' (n, w * E) per filter width (rows of
        w characters' embeddings, as _filters_by_gemm lays its windows), 'highways', 'proj' (None without one);
        cached, re-made when a parameter changes."""
        key = onednn.params_key(self.parameters())
        cached = self.__dict__.get("_onednn_weights")
        if cached is None or cached[0] != key:
            self.__dict__["_onednn_weights"] = None          # the old packing's memory first
            cached = (key, {"convs": [onednn.pack(c.weight.permute(0, 2, 1).reshape(c.weight.shape[0], -1))
                                      for c in self.convs],
                            "highways": [onednn.pack(hw.linear.weight) for hw in self.highways],
                            "proj": onednn.pack(self.proj.weight) if self.proj is not None else None})
            self.__dict__["_onednn_weights"] = cached
        return cached[1]

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle: without the packed weights (they cannot be copied; made again on use)."""
        state = self.__dict__.copy()
        state.pop("_onednn_weights", None)
        return state

    def _highways(self, h: Tensor, batch_invariant: bool, packed: dict | None) -> Tensor:
        """(N, n_filters) filter outputs -> (N, P): the highway layers, then the projection if any.
        packed: _packed() to run the GEMMs on oneDNN, else None."""
        for k, hw in enumerate(self.highways):
            h = hw(h, batch_invariant, None if packed is None else packed["highways"][k])
        if self.proj is None:
            return h
        if batch_invariant:
            return invariant_linear(self.proj, h, None if packed is None else packed["proj"])
        return self.proj(h) if packed is None else onednn.linear(h, packed["proj"], self.proj.bias)

    def _filters_by_conv(self, char_ids: Tensor) -> Tensor:
        """(N, C) ids -> (N, n_filters) by nn.Conv1d (autograd)."""
        x = self.char_embed(char_ids).transpose(1, 2)            # (N, E, C)
        # bilm-tf max-pools over time, then applies the activation (the same, both monotonic).
        return torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)

    def _filters_in_chunks(self, char_ids: Tensor, packed: dict | None, batch_invariant: bool = False) -> Tensor:
        """(N, C) ids -> (N, n_filters), _filters_by_gemm over chunks of CNN_CHUNK (packed: CNN_CHUNK_ONEDNN) tokens
        (bounded memory)."""
        chunk = CNN_CHUNK if packed is None else CNN_CHUNK_ONEDNN
        return torch.cat([self._filters_by_gemm(char_ids[s: s + chunk], packed, batch_invariant)
                          for s in range(0, char_ids.shape[0], chunk)])

    def _filters_by_gemm(self, char_ids: Tensor, packed: dict | None, batch_invariant: bool = False) -> Tensor:
        """The convolutions as GEMMs over unfolded character windows (inference; faster than mkldnn's conv1d here):
        (m, C) ids -> (m, n_filters). Per filter width w: (m * (C-w+1), w * E) @ (w * E, n), max over
        positions, then bias and activation (max(x + b) = max(x) + b exactly; the activation is monotonic).
        packed: _packed() to run the GEMMs on oneDNN, else None (torch.mm). batch_invariant: m a multiple of
        ROW_TILE, each GEMM on checked row counts (model/row_tile.py)."""
        x = self.char_embed(char_ids)                                   # (m, C, E)
        m, C, E = x.shape
        out = []
        for k, conv in enumerate(self.convs):
            n, _, w = conv.weight.shape                                 # Conv1d weight (n, E, w)
            windows = x.unfold(1, w, 1).transpose(2, 3).reshape(m * (C - w + 1), w * E)   # rows (w, E)
            if packed is None:
                weight = conv.weight.permute(2, 1, 0).reshape(w * E, n)

                def gemm(rows, weight=weight):
                    return torch.mm(rows, weight)
                op = "mm"
            else:
                def gemm(rows, weight=packed["convs"][k]):
                    return onednn.linear(rows, weight)
                op = "onednn"
            if batch_invariant:
                y = in_pieces(gemm, windows, row_rule_of(op, w * E, n, x.dtype))
            else:
                y = gemm(windows)
            out.append(self.activation(y.view(m, C - w + 1, n).amax(dim=1).add_(conv.bias)))
        return torch.cat(out, dim=-1)


class WordEncoder(nn.Module):
    """Token vectors from a word-embedding table: (N,) int64 ids -> (N, P)."""

    def __init__(self, opts: BiLMOptions):
        super().__init__()
        self.embedding = nn.Embedding(opts.n_tokens_vocab, opts.projection_dim)

    def forward(self, token_ids: Tensor, batch_invariant: bool = False) -> Tensor:
        return self.embedding(token_ids)      # a table lookup: the same bits in any batch
