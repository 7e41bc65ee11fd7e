"""The ELMo biLM (Peters et al. 2018) in plain PyTorch, in bilm-tf's conventions.

token encoder (char CNN + highway + projection, or a word-embedding table)
  -> n_layers LSTMs with cell clip, projection and projection clip, per direction
  -> per layer: concat(forward, backward)

Parameters are stored in bilm-tf's own layout (gate order, carry gate, forget bias at run time),
so loading and saving the published HDF5 files is a transpose and nothing else (model/weights.py).

Without autograd, sequences run in torch's packed layout (time-major, longest first), in place: each LSTM
layer's input projection is one GEMM over the real tokens only, the time loop touches only sentences still
running, and every sentence's result is independent of the others in its batch. With lanes (PackedBatch; the
embedder's stateless and warm modes) a batch's sentences run end to end in the loop's rows, each from the initial
state again, so nearly every row runs at every step. Under autograd (training)
BiLM.forward runs the padded path of model/padded_forward.py instead: the same math, faster backward passes.

batch_invariant=True (inference; forward, forward_tokens, encode_tokens): a sentence's vectors are the same
bits whatever else is in its batch. The CPU GEMM kernels give a row the same bits for every row count that
is a multiple of ROW_TILE, and other bits for 1-3 rows (and, at 2 threads, for some other counts); so every
GEMM gets a multiple of ROW_TILE rows: the token encoder's inputs are padded with all-padding tokens, and the
LSTMs run in a padded packed layout where step t has round_up(n_t, ROW_TILE) rows (the extra rows get zero
inputs; they are computed and thrown away). Highway's sigmoid is exp(-x) + 1 -> reciprocal, whose vector and
scalar code agree (torch.sigmoid's scalar tail differs from its vector body, and where the tail falls depends
on the tensor's size). See docs/exactness.md.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.batching import pack_lanes
from model.device import host_side, upload
from model.options import BiLMOptions
from model.padded_forward import padded_forward

N_CHAR_ROWS = 262  # 261 trained character rows + row 0, all zeros, for padded positions


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

    def forward(self, x: Tensor, batch_invariant: bool = False) -> Tensor:  # (N, d) -> (N, d)
        transform, carry = self.linear(x).split(self.dim, dim=-1)
        # batch_invariant: a sigmoid whose result does not depend on where the element falls in the tensor
        t = torch.exp(-carry).add_(1.0).reciprocal_() if batch_invariant else torch.sigmoid(carry)
        return t * F.relu(transform) + (1.0 - t) * x


class CharCNNEncoder(nn.Module):
    """Token vectors from character ids: (N, max_chars) int64 (+1 shifted, 0 = padding) -> (N, P)."""

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
        if batch_invariant and not torch.is_grad_enabled():
            # every GEMM below gets a multiple of ROW_TILE rows: pad with all-padding tokens (char id 0)
            n = char_ids.shape[0]
            pad = _round_up(n, ROW_TILE) - n
            if pad:
                char_ids = torch.cat([char_ids, char_ids.new_zeros(pad, *char_ids.shape[1:])])
            return self._encode(char_ids, True)[:n]
        return self._encode(char_ids, False)

    def _encode(self, char_ids: Tensor, batch_invariant: bool) -> Tensor:
        if torch.is_grad_enabled():
            x = self.char_embed(char_ids).transpose(1, 2)            # (N, E, C)
            # bilm-tf max-pools over time, then applies the activation (the same, both monotonic).
            h = torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)
        else:
            h = torch.cat([self._filters_by_gemm(char_ids[s: s + CNN_CHUNK])
                           for s in range(0, char_ids.shape[0], CNN_CHUNK)])
        for hw in self.highways:
            h = hw(h, batch_invariant)
        return self.proj(h) if self.proj is not None else h     # (N, P)

    def _filters_by_gemm(self, char_ids: Tensor) -> Tensor:
        """The convolutions as GEMMs over unfolded character windows (inference; faster than mkldnn's conv1d here):
        (m, C) ids -> (m, n_filters). Per filter width w: (m * (C-w+1), w * E) @ (w * E, n), max over
        positions, then bias and activation (max(x + b) = max(x) + b exactly; the activation is monotonic)."""
        x = self.char_embed(char_ids)                                   # (m, C, E)
        m, C, E = x.shape
        out = []
        for conv in self.convs:
            n, _, w = conv.weight.shape                                 # Conv1d weight (n, E, w)
            windows = x.unfold(1, w, 1).transpose(2, 3).reshape(m * (C - w + 1), w * E)   # rows (w, E)
            weight = conv.weight.permute(2, 1, 0).reshape(w * E, n)
            y = torch.mm(windows, weight).view(m, C - w + 1, n).amax(dim=1)
            out.append(self.activation(y.add_(conv.bias)))
        return torch.cat(out, dim=-1)


# Tokens per chunk of the char CNN's GEMMs: (512 * 44, 112) @ (112, 1024) for the widest filter of the
# published models, output about 90 MB whatever the number of distinct tokens. A multiple of ROW_TILE.
CNN_CHUNK = 512

# batch_invariant: every GEMM's row count is a multiple of this. Measured on torch 2.13's CPU GEMMs (AMD EPYC,
# AVX-512, 1 and 2 threads): a row's bits are the same for every multiple of 4 rows, at any row position;
# 1-3 rows take another kernel, and at 2 threads 5-7 and 9-11 rows can differ too.
ROW_TILE = 4


def _round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


class WordEncoder(nn.Module):
    """Token vectors from a word-embedding table: (N,) int64 ids -> (N, P)."""

    def __init__(self, opts: BiLMOptions):
        super().__init__()
        self.embedding = nn.Embedding(opts.n_tokens_vocab, opts.projection_dim)

    def forward(self, token_ids: Tensor, batch_invariant: bool = False) -> Tensor:
        return self.embedding(token_ids)      # a table lookup: the same bits in any batch


class LstmProjection(nn.Module):
    """One LSTM layer with projected output, as TF's LSTMCell(num_proj, cell_clip, proj_clip).

    Gate rows of w_in / w_rec / bias are in TF's order: i (input), j (candidate), f (forget),
    o (output). TF keeps forget_bias=1.0 out of the weights and adds it at run time; so do we.
      c' = clip(sigmoid(f + 1) * c + sigmoid(i) * tanh(j), cell_clip)
      h' = clip((sigmoid(o) * tanh(c')) @ w_proj.T, proj_clip)
    Shapes: w_in (4H, D_in), w_rec (4H, P), bias (4H,), w_proj (P, H).
    Parameters only: run_lstm_layers (inference) and model/padded_forward.py (autograd) run it.
    """

    def __init__(self, input_dim: int, dim: int, proj_dim: int, cell_clip: float | None, proj_clip: float | None):
        super().__init__()
        self.dim, self.proj_dim = dim, proj_dim
        self.cell_clip, self.proj_clip = cell_clip, proj_clip
        self.w_in = nn.Parameter(torch.empty(4 * dim, input_dim))
        self.w_rec = nn.Parameter(torch.empty(4 * dim, proj_dim))
        self.bias = nn.Parameter(torch.zeros(4 * dim))
        self.w_proj = nn.Parameter(torch.empty(proj_dim, dim))
        forget = torch.zeros(4 * dim)
        forget[2 * dim: 3 * dim] = 1.0
        self.register_buffer("forget_bias", forget, persistent=False)
        for w in (self.w_in, self.w_rec, self.w_proj):
            nn.init.xavier_uniform_(w)


def stack_weights(layers: list[LstmProjection]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The G layers' weights stacked for batched GEMMs, gate columns reordered from TF's (i, j, f, o)
    to (i, f, o, j) so that the three sigmoid gates are one contiguous slice:
    bias with TF's forget bias (G, 1, 4H), w_in (G, D_in, 4H), w_rec (G, P, 4H), w_proj (G, H, P)."""
    H = layers[0].dim
    perm = torch.cat([torch.arange(0, H), torch.arange(2 * H, 4 * H), torch.arange(H, 2 * H)])
    perm = perm.to(layers[0].bias.device)
    return (torch.stack([(l.bias + l.forget_bias)[perm] for l in layers])[:, None],
            torch.stack([l.w_in[perm].t() for l in layers]),
            torch.stack([l.w_rec[perm].t() for l in layers]),
            torch.stack([l.w_proj.t() for l in layers]))


# Rows of the input projection computed at once: (G, rows, 4H) floats of about 2**24 elements
# (64 MB in fp32), so a batch of any size needs bounded memory and each GEMM is still large.
CHUNK_ELEMENTS = 1 << 24


def _chunks(batch_sizes: list[int], max_rows: int) -> list[tuple[int, int, int]]:
    """Consecutive steps grouped so each group has <= max_rows packed rows (at least one step).
    Returns (first step, end step, rows) per group."""
    out, t = [], 0
    while t < len(batch_sizes):
        end, rows = t + 1, batch_sizes[t]
        while end < len(batch_sizes) and rows + batch_sizes[end] <= max_rows:
            rows += batch_sizes[end]
            end += 1
        out.append((t, end, rows))
        t = end
    return out


_WORKSPACE = threading.local()   # per thread: callers may share one model across threads


def _workspace(numel: int, like: Tensor) -> Tensor:
    """A flat buffer of >= numel elements of like's dtype/device, kept for this thread and reused.
    Reusing it matters on CPU: a fresh tensor this large is new pages from the OS each time, and
    first-touch page faults cost about a quarter of the input-projection GEMM's time."""
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    key = (like.dtype, like.device, torch.is_inference_mode_enabled())   # inference tensors stay in it
    if key not in buffers or buffers[key].numel() < numel:
        buffers[key] = like.new_empty(numel)
    return buffers[key]


# The LSTM loop's GEMMs (one list per choice): 'onednn' = oneDNN's linear with prepacked weights and fused
# activations (CPU; on AMD CPUs MKL's sgemm reached 43 % of oneDNN's fp32 rate, benchmarks/README.md),
# 'bmm' = torch.bmm / baddbmm_ for both directions at once (CUDA, and CPUs without oneDNN).
# 'auto' picks oneDNN on a CPU that has it for the dtype. ELMO_LSTM_GEMM=bmm forces the other (side-by-side runs).
LSTM_GEMMS = ("auto", "onednn", "bmm")
LSTM_GEMM = os.environ.get("ELMO_LSTM_GEMM", "auto")


def lstm_gemm(device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM implementation the LSTM loop uses for weights on this device and dtype: 'onednn' or 'bmm'."""
    if LSTM_GEMM not in LSTM_GEMMS:
        raise ValueError(f"ELMO_LSTM_GEMM must be one of {LSTM_GEMMS}, got {LSTM_GEMM!r}")
    if LSTM_GEMM != "auto":
        return LSTM_GEMM
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "bmm"
    supported = {torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    return "onednn" if supported.get(dtype, False) else "bmm"


def pack_onednn_weights(layers: list[LstmProjection]) -> list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
    """Per layer, oneDNN-prepacked weights for run_lstm_layers' CPU loop, where one GEMM per gate group reads
    [x_t, h_{t-1}] (D_in + P wide): (w_sig (3H, D_in+P) for gates i, f, o, their bias with TF's forget bias (3H,),
    w_j (H, D_in+P), bias_j (H,), w_proj (P, H)), weights in nn.Linear's (out, in) layout."""
    H = layers[0].dim
    packed = []
    for l in layers:
        w = torch.cat([l.w_in, l.w_rec], dim=1).detach()             # (4H, D_in + P), TF gate order i, j, f, o
        b = (l.bias + l.forget_bias).detach()
        sig = torch.cat([torch.arange(0, H), torch.arange(2 * H, 4 * H)]).to(w.device)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        packed.append((reorder(w[sig].contiguous()), b[sig].contiguous(),
                       reorder(w[H: 2 * H].contiguous()), b[H: 2 * H].contiguous(),
                       reorder(l.w_proj.detach().contiguous())))
    return packed


def run_lstm_layers(layers: list[LstmProjection], weights, x: Tensor,
                    batch_sizes: list[int], h0: Tensor, c0: Tensor, step_rows: list[int] | None = None,
                    resets: Resets | None = None):
    """Run G independent LSTM layers of equal shapes in lock-step (e.g. the forward and the backward
    direction, which share the packed step sizes). Inference only (in place, no autograd);
    model/padded_forward.py is the path under autograd.

    weights: pack_onednn_weights(layers) (the oneDNN loop) or stack_weights(layers) (the bmm loop), as
    lstm_gemm() chose. x (G, N, D_in) packed; h0 (G, B, P), c0 (G, B, H) in packed row order.
    Returns outputs (G, N, P) and final states h (G, B, P), c (G, B, H).

    step_rows (batch_invariant): rows computed at each step, >= batch_sizes[t] and non-increasing (a padded
    packed layout: step t's first batch_sizes[t] rows are the live sequences, the rest are computed and their
    outputs are junk). x, the outputs and h0/c0 then have step_rows rows per step / step_rows[0] rows; the final
    states are still each sequence's own, taken when it ends.

    resets (lanes, PackedBatch.resets: Resets): before a step, the rows of the layers it names take their state
    from h0/c0 again (a new sentence starts in that lane).
    """
    step_rows = batch_sizes if step_rows is None else step_rows
    if not step_rows:
        return x.new_empty(len(layers), 0, layers[0].proj_dim), h0, c0
    loop = _onednn_loop if isinstance(weights, list) else _bmm_loop
    return loop(layers, weights, x, batch_sizes, step_rows, h0, c0, resets or NO_RESETS)


class Resets:
    """Where lanes of several sentences restart (PackedBatch.resets): before step t, the (layer, row) pairs
    at(t) take their initial state again (a new sentence starts in that lane). `step in resets` says whether any
    do. The oneDNN loop writes those rows in place (at: 4 small kernels); the bmm loop selects whole steps by
    mask(t) (G, width, 1) bool, 2 kernels a step, the masks built on the device for the whole batch on first use
    (2 kernels). dirs, rows, index: device int64 per pair (layer, row, index of its step among the resets);
    spans: step -> (start, end, index) into them; width: rows of the widest step."""

    def __init__(self, dirs: Tensor, rows: Tensor, index: Tensor, spans: dict[int, tuple[int, int, int]],
                 width: int):
        self.dirs, self.rows, self.index, self.spans, self.width = dirs, rows, index, spans, width
        self._masks = None

    def __contains__(self, step: int) -> bool:
        return step in self.spans

    def at(self, step: int) -> tuple[Tensor, Tensor]:
        a, b, _ = self.spans[step]
        return self.dirs[a:b], self.rows[a:b]

    def mask(self, step: int) -> Tensor:
        if self._masks is None:
            masks = torch.zeros(len(self.spans), 2, self.width, 1, dtype=torch.bool, device=self.dirs.device)
            masks[self.index, self.dirs, self.rows] = True
            self._masks = masks
        return self._masks[self.spans[step][2]]


NO_RESETS = Resets(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                   torch.empty(0, dtype=torch.int64), {}, 0)


def _reset(h: Tensor, c: Tensor, h0: Tensor, c0: Tensor, at: tuple[Tensor, Tensor]) -> None:
    """In place: h (G, n, P) and c (G, n, H) at (layer, row) pairs `at` from h0/c0 (4 kernels, no host sync)."""
    h.index_put_(at, h0[at])
    c.index_put_(at, c0[at])


def _onednn_loop(layers, weights, x, batch_sizes, step_rows, h0, c0, resets):
    """run_lstm_layers on a CPU: per step and direction, gates = act([x_t, h] @ W.T + b) by oneDNN with the
    activations fused (sigmoid for i, f, o; tanh for j), the cell update in place, then the projection with its
    clip fused (hardtanh). Every GEMM reads the step's rows once; nothing of the size of the gates is written
    twice, and the packed weights stream through once per step."""
    linear = torch.ops.mkldnn._linear_pointwise
    first = layers[0]
    G, H, P, D = len(layers), first.dim, first.proj_dim, x.shape[-1]
    cell_clip, proj_clip = first.cell_clip, first.proj_clip
    clip = ("hardtanh", [-proj_clip, proj_clip]) if proj_clip is not None else ("none", [])
    live = h0.shape[1] if step_rows is batch_sizes else batch_sizes[0]
    y = x.new_empty(G, sum(step_rows), P)                # every step's h, written in place
    xh = x.new_empty(G, step_rows[0], D + P)             # [x_t, h_{t-1}] of the step's rows
    out = x.new_empty(step_rows[0], H)                   # sigmoid(o) * tanh(c) of the step's rows
    c = c0.clone()                                       # (G, rows, H), each step updates its first rows
    h, done_h, done_c, offset = h0, [], [], 0
    for step, (n, m) in enumerate(zip(batch_sizes, step_rows)):
        if n < live:                           # sequences [n:live) have ended: keep their final state
            done_h.append(h[:, n:live])
            done_c.append(c[:, n:live].clone())
            live = n
        xh[:, :m, :D] = x[:, offset: offset + m]
        xh[:, :m, D:] = h[:, :m]
        if step in resets:
            _reset(xh[:, :, D:], c, h0, c0, resets.at(step))
        for g, (w_sig, b_sig, w_j, b_j, w_proj) in enumerate(weights):
            sig = linear(xh[g, :m], w_sig, b_sig, "sigmoid", [], "")     # (m, 3H): i, f, o
            j = linear(xh[g, :m], w_j, b_j, "tanh", [], "")               # (m, H)
            i, f, o = sig.split(H, dim=1)
            cg = c[g, :m].mul_(f).addcmul_(i, j)
            if cell_clip is not None:
                cg.clamp_(-cell_clip, cell_clip)
            y[g, offset: offset + m] = linear(torch.tanh(cg, out=out[:m]).mul_(o), w_proj, None, *clip, "")
        h, offset = y[:, offset: offset + m], offset + m
    return y, *_final_state(h, c, live, done_h, done_c)


def _final_state(h: Tensor, c: Tensor, live: int, done_h: list[Tensor], done_c: list[Tensor]):
    """Each sequence's final (h, c) in packed row order: the sequences still live after the last step, then
    those that ended earlier (recorded as they ended, latest first)."""
    h, c = h[:, :live].clone(), c[:, :live].clone()     # h: a view into y, which callers may change in place
    h_final = torch.cat([h, *reversed(done_h)], dim=1) if done_h else h
    c_final = torch.cat([c, *reversed(done_c)], dim=1) if done_c else c
    return h_final, c_final


def _cell_eager(gates: Tensor, c: Tensor, cell_clip: float | None, out: Tensor) -> tuple[Tensor, Tensor]:
    """The LSTM cell's pointwise work, in place: gates (G, n, 4H) before activation in order i, f, o, j and
    c (G, n, H) -> (c' = clip(sigmoid(f) * c + sigmoid(i) * tanh(j)), sigmoid(o) * tanh(c') in out (G, n, H)).
    c' is written into gates' f columns (the bmm loop's c lives in its gate buffer between steps)."""
    H = c.shape[-1]
    sig = gates[..., : 3 * H].sigmoid_()
    j = gates[..., 3 * H:].tanh_()
    i, f, o = sig.split(H, dim=-1)
    c = f.mul_(c).addcmul_(i, j)
    if cell_clip is not None:
        c.clamp_(-cell_clip, cell_clip)
    return c, torch.tanh(c, out=out).mul_(o)


def _cell_fused(gates: Tensor, c: Tensor, cell_clip: float | None, out: Tensor) -> tuple[Tensor, Tensor]:
    """_cell_eager's math out of place, for torch.compile to fuse into one kernel: (c', sigmoid(o) * tanh(c'))."""
    H = c.shape[-1]
    i, f, o = gates[..., : 3 * H].sigmoid().split(H, dim=-1)
    c = f * c + i * gates[..., 3 * H:].tanh()
    if cell_clip is not None:
        c = c.clamp(-cell_clip, cell_clip)
    return c, o * c.tanh()


_COMPILED_CELL = {}


def _cell(gates: Tensor, c: Tensor, cell_clip: float | None, out: Tensor) -> tuple[Tensor, Tensor]:
    """The cell's pointwise work: on a GPU one fused kernel (torch.compile of _cell_fused: 1 launch a step
    instead of 7; ELMO_COMPILE_CELL=0 turns it off), elsewhere _cell_eager (in place, no allocation)."""
    if gates.device.type != "cuda" or os.environ.get("ELMO_COMPILE_CELL", "1") == "0":
        return _cell_eager(gates, c, cell_clip, out)
    if "fn" not in _COMPILED_CELL:
        _COMPILED_CELL["fn"] = torch.compile(_cell_fused, dynamic=True, fullgraph=True)
    return _COMPILED_CELL["fn"](gates, c, cell_clip, out)


def _bmm_loop(layers, weights, x, batch_sizes, step_rows, h0, c0, resets):
    """run_lstm_layers with one batched GEMM per step for all G layers (torch.bmm: cuBLAS on a GPU). The input
    projection is computed for chunks of consecutive steps (about CHUNK_ELEMENTS floats each)."""
    first = layers[0]
    G, H, cell_clip, proj_clip = len(layers), first.dim, first.cell_clip, first.proj_clip
    bias, w_in, w_rec, w_proj = weights
    h, c = h0, c0
    live = h0.shape[1] if step_rows is batch_sizes else batch_sizes[0]
    done_h, done_c = [], []
    y = x.new_empty(G, sum(step_rows), first.proj_dim)   # every step's h written in place: no cat
    offset = 0
    max_rows = max(1, CHUNK_ELEMENTS // (G * 4 * H))
    chunks = _chunks(step_rows, max_rows)
    # the gates of every chunk in one reused buffer; c lives in it between steps
    ws = _workspace(G * max(rows for _, _, rows in chunks) * 4 * H, x)
    tanh_c = x.new_empty(G * step_rows[0] * H)
    for t0, t1, rows in chunks:
        c = c.clone() if t0 else c          # c is a view into the previous chunk's rows of ws
        xw = torch.bmm(x[:, offset: offset + rows], w_in, out=ws[: G * rows * 4 * H].view(G, rows, 4 * H))
        xw.add_(bias)                                                   # (G, rows, 4H)
        base, offset = offset, offset + rows
        r = 0
        for step, (n, m) in enumerate(zip(batch_sizes[t0:t1], step_rows[t0:t1]), start=t0):
            if n < live:                       # sequences [n:live) have ended: keep their final state
                done_h.append(h[:, n:live])
                done_c.append(c[:, n:live].clone())                     # c may be a view into xw
                live = n
            if m < h.shape[1]:
                h, c = h[:, :m], c[:, :m]
            if step in resets:                 # h is a view of the previous step's output: selected, not written
                restart = resets.mask(step)[:, :m]                      # (G, m, 1)
                h = torch.where(restart, h0[:, :m], h)
                c = torch.where(restart, c0[:, :m], c, out=c)
            n = m                              # rows computed at this step
            gates = xw[:, r: r + n]
            r += n
            # everything in xw's own rows: no per-step allocations but h
            gates.baddbmm_(h, w_rec)
            c, out = _cell(gates, c, cell_clip, tanh_c[: G * n * H].view(G, n, H))
            h = torch.bmm(out, w_proj, out=y[:, base + r - n: base + r])
            if proj_clip is not None:
                h.clamp_(-proj_clip, proj_clip)
    return y, *_final_state(h, c, live, done_h, done_c)


class PackedBatch:
    """Index maps between a padded (B, T) batch and the packed layouts of both directions, built on the host
    from the host-side lengths and sent to the device in one copy (model/device.py: upload).

    The LSTMs run over lanes: one sentence each, or with lanes=True several laid end to end
    (model.batching.pack_lanes, capacity T), each starting from the initial state again (`resets`), so that
    nearly every lane runs at every step. The packed layout is time-major over the lanes, longest first.
    Packed element k of the forward direction is flat position fwd_index[k] (= row * T + t);
    of the backward direction, bwd_index[k] (each lane reversed, so each of its sentences is reversed within
    its own length); bwd_from_fwd[k] is the forward packed element holding the same token as backward element k.
    `order` is, per lane in packed order, the batch row whose initial state the lane takes (its first
    sentence); `inv_order` its inverse while every lane holds one sentence (lanes == B), else None.
    resets (Resets): the (direction, row) pairs (0 forward, 1 backward; rows of the step) where a new sentence
    starts at a step: those rows take their initial state again. Empty when lanes hold one sentence.
    tokens=True: fwd_rows / bwd_rows (the tokens layout, see _token_rows) instead of fwd_index / bwd_index.
    batch_invariant=True: step_rows (rows per step, multiples of ROW_TILE) and `at` (padded position of each
    packed element). extra(fwd_index_host) -> more host int64 tensors to send in the same copy.
    Host attributes: lengths, batch_sizes, lanes (their number), rows / steps and bwd_rows_host / bwd_steps (each
    packed element's sentence and position in it, per direction), step_rows; everything else is on `device`.
    """

    def __init__(self, lengths: Tensor, max_len: int, device: torch.device, *, tokens: bool = False,
                 batch_invariant: bool = False, extra=None, lanes: bool = False):
        with host_side():
            lengths = torch.as_tensor(lengths).to("cpu", torch.int64)   # host data (a device tensor here syncs)
            self.lengths = lengths
            B, T = len(lengths), max_len
            if lanes and B > 1:
                lane_of, start = (torch.tensor(v, dtype=torch.int64) for v in pack_lanes(lengths.tolist(), T))
            else:
                lane_of, start = torch.arange(B), torch.zeros(B, dtype=torch.int64)
            L = int(lane_of.max()) + 1 if B else 0
            self.lanes = L
            lane_len = torch.zeros(L, dtype=torch.int64).index_add_(0, lane_of, lengths)
            first = torch.zeros(L, dtype=torch.int64)                   # each lane's first sentence
            first[lane_of[start == 0]] = torch.arange(B)[start == 0]
            sorted_len, lane_order = torch.sort(lane_len, descending=True, stable=True)
            steps = torch.arange(T)
            active = steps[:, None] < sorted_len[None, :]                   # (T, L)
            self.batch_sizes = active.sum(dim=1).tolist()
            while self.batch_sizes and self.batch_sizes[-1] == 0:
                self.batch_sizes.pop()
            lane = lane_order[None, :].expand(T, -1)[active]                # per packed element, time-major
            t = steps[:, None].expand(-1, L)[active]
            # which sentence, and which of its positions, sits at each slot of each lane
            sent = torch.repeat_interleave(torch.arange(B), lengths)
            pos = torch.arange(len(sent)) - (torch.cumsum(lengths, 0) - lengths)[sent]
            sent_at = torch.zeros(L, T, dtype=torch.int64)
            pos_at = torch.zeros(L, T, dtype=torch.int64)
            sent_at[lane_of[sent], start[sent] + pos] = sent
            pos_at[lane_of[sent], start[sent] + pos] = pos
            back = lane_len[lane] - 1 - t                                   # the backward direction's slot
            self.rows, self.steps = sent_at[lane, t], pos_at[lane, t]
            self.bwd_rows_host, self.bwd_steps = sent_at[lane, back], pos_at[lane, back]
            fwd = self.rows * T + self.steps
            bwd = self.bwd_rows_host * T + self.bwd_steps
            packed_at = torch.empty(B * T, dtype=torch.int64)
            packed_at[fwd] = torch.arange(len(fwd))
            order = first[lane_order]
            host = {"order": order, "bwd_from_fwd": packed_at[bwd]}
            if L == B:
                inv = torch.empty_like(order)
                inv[order] = torch.arange(B)
                host["inv_order"] = inv
            else:
                self.inv_order = None
            if tokens:
                host["fwd_rows"], host["bwd_rows"], self.n_tokens = self._token_rows()
            else:
                host["fwd_index"], host["bwd_index"] = fwd, bwd
            self.step_rows = None
            firsts = torch.tensor([0, *self.batch_sizes[:-1]], dtype=torch.int64).cumsum(0)
            if batch_invariant and self.batch_sizes:
                self.step_rows = [_round_up(n, ROW_TILE) for n in self.batch_sizes]
                # padded position of each packed element: step t's rows start at sum(step_rows[:t])
                starts = torch.tensor([0, *self.step_rows[:-1]], dtype=torch.int64).cumsum(0)
                host["at"] = starts[t] + torch.arange(len(t)) - firsts[t]
            resets = self._resets(t, firsts, lengths)
            if resets is not None:
                host["reset_dirs"], host["reset_rows"], host["reset_index"], spans = resets
            if extra is not None:
                host.update(extra(fwd))
        self.host = host
        for name, tensor in upload(host, device).items():
            setattr(self, name, tensor)
        self.resets = NO_RESETS if resets is None else \
            Resets(self.reset_dirs, self.reset_rows, self.reset_index, spans, self.step_rows[0] if self.step_rows else L)

    def _resets(self, t: Tensor, firsts: Tensor, lengths: Tensor):
        """Where a sentence other than a lane's first starts: None when nowhere, else (direction, row of its
        step, index of its step among these steps) of each such element, sorted by step, and
        {step: (start, end, index)} into them."""
        fwd = (self.steps == 0) & (t > 0)
        bwd = (self.bwd_steps == lengths[self.bwd_rows_host] - 1) & (t > 0)
        if not bool(fwd.any()) and not bool(bwd.any()):
            return None
        row = torch.arange(len(t)) - firsts[t]                        # row of each element within its step
        step = torch.cat([t[fwd], t[bwd]])
        order = torch.argsort(step, stable=True)
        dirs = torch.cat([torch.zeros(int(fwd.sum()), dtype=torch.int64), torch.ones(int(bwd.sum()), dtype=torch.int64)])
        steps, index, counts = torch.unique_consecutive(step[order], return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).tolist()
        spans = {s: (e - n, e, k) for k, (s, n, e) in enumerate(zip(steps.tolist(), counts.tolist(), ends))}
        return dirs[order], torch.cat([row[fwd], row[bwd]])[order], index, spans

    def _token_rows(self) -> tuple[Tensor, Tensor, int]:
        """Rows of the tokens layout for each packed element of both directions: the real tokens (neither
        <S> nor </S>) of row b at offsets[b] + position - 1, sentence after sentence; the boundary tokens
        at n + 2b and n + 2b + 1, past the n real tokens. Returns (fwd_rows, bwd_rows, n) on the host."""
        real = self.lengths - 2
        starts = torch.cumsum(real, 0) - real
        n = int(real.sum())

        def rows_of(r: Tensor, pos: Tensor) -> Tensor:
            inside = (pos >= 1) & (pos <= self.lengths[r] - 2)
            return torch.where(inside, starts[r] + pos - 1, n + 2 * r + (pos > 0).long())

        return rows_of(self.rows, self.steps), rows_of(self.bwd_rows_host, self.bwd_steps), n


class TokenCache:
    """Token-encoder outputs by token (its char-id row), so frequent words skip the char CNN.
    Looked up on the host (lookup, from the host's char ids), filled on the device (assemble)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.vectors: dict[bytes, Tensor] = {}
        self.params_key = None

    def lookup(self, uniq: Tensor, encoder: nn.Module, batch_invariant: bool = False
               ) -> tuple[list[bytes], list[int], list[int]]:
        """uniq (U, ...) host token inputs -> (keys, missing, hits): positions in uniq not cached / cached.
        The vectors of one batch_invariant setting are never served to the other (they may differ in the
        last bits): switching forgets the cache; so do changed weights."""
        key = (batch_invariant, *((p.data_ptr(), p._version) for p in encoder.parameters()))
        if key != self.params_key:          # weights changed: forget everything
            self.vectors, self.params_key = {}, key
        with host_side():
            keys = [row.tobytes() for row in uniq.to("cpu", torch.int16).numpy()]
        missing = [i for i, k in enumerate(keys) if k not in self.vectors]
        hits = [i for i, k in enumerate(keys) if k in self.vectors] if len(missing) < len(keys) else []
        return keys, missing, hits

    def assemble(self, keys: list[bytes], missing: list[int], hits: list[int], new_inputs: Tensor,
                 missing_at: Tensor | None, hits_at: Tensor | None, encoder: nn.Module,
                 batch_invariant: bool = False) -> Tensor:
        """(U, P) vectors of lookup()'s tokens: the cached ones, and the missing ones (new_inputs: their inputs,
        on the device) through the encoder; keeps new ones while there is room. missing_at / hits_at: the
        positions of missing / hits on the device (None when all are missing)."""
        new = encoder(new_inputs, batch_invariant) if missing else None
        if not hits:
            out = new
        else:
            cached = torch.stack([self.vectors[keys[i]] for i in hits])
            out = cached.new_empty(len(keys), cached.shape[1])
            out.index_copy_(0, hits_at, cached)
            if missing:
                out.index_copy_(0, missing_at, new)
        room = max(0, self.max_tokens - len(self.vectors))
        if missing and room:
            kept = new[:room].clone()              # one copy for all kept rows; entries are views of it
            for j, i in enumerate(missing[:room]):
                self.vectors[keys[i]] = kept[j]
        return out


class BiLM(nn.Module):
    """The bidirectional LM. forward(inputs, lengths, state) -> (layers, state).

    inputs: (B, T, max_chars) char ids (char CNN) or (B, T) token ids (word encoder), boundary
    tokens <S> </S> included, 0 at padded positions; lengths (B,) >= 1.
    layers: (n_layers + 1, B, T, 2P): [0] the token vectors duplicated, [k] concat(fwd_k, bwd_k);
    zeros at padded positions.
    state: (h, c) with h (2, n_layers, B, P), c (2, n_layers, B, H) in batch-row order; index 0 is the
    forward direction. None means zeros. The returned state is each row's state after its sequence.
    Without autograd: the packed in-place path below; with autograd: model/padded_forward.py.
    """

    def __init__(self, opts: BiLMOptions, dropout: float = 0.0):
        super().__init__()
        self.opts = opts
        self.dropout = dropout
        self.token_encoder = CharCNNEncoder(opts) if opts.char_cnn is not None else WordEncoder(opts)
        P, H = opts.projection_dim, opts.lstm_dim

        def stack():
            return nn.ModuleList(LstmProjection(P, H, P, opts.cell_clip, opts.proj_clip) for _ in range(opts.n_layers))

        self.forward_layers = stack()
        self.backward_layers = stack()

    @property
    def n_layers(self) -> int:
        return self.opts.n_layers

    @property
    def output_dim(self) -> int:
        return self.opts.output_dim

    def zero_state(self, batch_size: int, device=None, dtype=None) -> tuple[Tensor, Tensor]:
        p = next(self.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        L, P, H = self.opts.n_layers, self.opts.projection_dim, self.opts.lstm_dim
        return (torch.zeros(2, L, batch_size, P, device=device, dtype=dtype),
                torch.zeros(2, L, batch_size, H, device=device, dtype=dtype))

    def encode_tokens(self, inputs: Tensor, batch_invariant: bool = False) -> Tensor:
        """Token vectors for (N, max_chars) char ids or (N,) token ids -> (N, P).
        On the CPU the encoder runs once per distinct token: repeated words cost nothing extra. On another
        device every row is encoded: finding the distinct rows there is a host sync (a data-dependent count),
        so the host-side dedup is forward_tokens' (its inputs arrive as host data)."""
        if inputs.shape[0] == 0:
            return inputs.new_zeros((0, self.opts.projection_dim), dtype=next(self.parameters()).dtype)
        if inputs.device.type != "cpu":
            return self.token_encoder(inputs, batch_invariant)
        uniq, inverse = torch.unique(inputs, dim=0, return_inverse=True)
        return self._encode_distinct(uniq, batch_invariant)[inverse]

    def _encode_distinct(self, uniq: Tensor, batch_invariant: bool = False) -> Tensor:
        """(U, ...) distinct token inputs -> (U, P), through the token cache when one is enabled (inference)."""
        cache = self.__dict__.get("token_cache")
        if cache is None or torch.is_grad_enabled():
            return self.token_encoder(uniq, batch_invariant)
        keys, missing, hits = cache.lookup(uniq, self.token_encoder, batch_invariant)
        with host_side():
            at = {"missing": torch.tensor(missing, dtype=torch.int64), "hits": torch.tensor(hits, dtype=torch.int64)}
        at = upload(at, uniq.device)
        return cache.assemble(keys, missing, hits, uniq.index_select(0, at["missing"]) if hits else uniq,
                              at["missing"], at["hits"], self.token_encoder, batch_invariant)

    def enable_token_cache(self, max_tokens: int) -> None:
        """Keep the vectors of up to max_tokens distinct tokens across batches (inference only).
        The first max_tokens distinct tokens seen are kept; in Zipfian text these are the frequent ones."""
        self.__dict__["token_cache"] = TokenCache(max_tokens) if max_tokens > 0 else None

    def _pair_weights(self, k: int):
        """Layer k's two directions' weights for run_lstm_layers, in the form lstm_gemm() chose for their device
        and dtype, cached (re-made only when a parameter changes: its storage or in-place version counter)."""
        layers = [self.forward_layers[k], self.backward_layers[k]]
        w = layers[0].w_rec
        gemm = lstm_gemm(w.device, w.dtype)
        key = (gemm, *((p.data_ptr(), p._version, p.dtype, p.device) for l in layers
                       for p in (l.w_in, l.w_rec, l.bias, l.w_proj)))
        cache = self.__dict__.setdefault("_weight_cache", {})
        if k not in cache or cache[k][0] != key:
            cache.pop(k, None)            # the old form's memory first (the original's weights are about 290 MB)
            cache[k] = (key, pack_onednn_weights(layers) if gemm == "onednn" else stack_weights(layers))
        return cache[k][1]

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(self, inputs: Tensor, lengths: Tensor, state: tuple[Tensor, Tensor] | None = None,
                batch_invariant: bool = False):
        """batch_invariant (inference only; ignored under autograd): each row's result in the same bits
        whatever the other rows (see the module docstring)."""
        if torch.is_grad_enabled():
            return padded_forward(self, inputs, lengths, state)
        B, T = inputs.shape[:2]
        pb = PackedBatch(lengths, T, inputs.device, batch_invariant=batch_invariant)
        emb = self.encode_tokens(inputs.reshape(B * T, *inputs.shape[2:]).index_select(0, pb.fwd_index),
                                 batch_invariant)                                                   # (N, P)
        out = emb.new_zeros(self.opts.n_layers + 1, B * T, 2 * emb.shape[-1])     # zeros at padded positions
        state = self._run_layers(emb, pb, state, out, pb.fwd_index, pb.bwd_index, batch_invariant)
        return out.view(-1, B, T, out.shape[-1]), state

    def prepare_tokens(self, uniq: Tensor, index: Tensor, lengths: Tensor, batch_invariant: bool = False,
                       lanes: bool = False) -> tuple[PackedBatch, Tensor]:
        """forward_tokens' first part: the packed layout and the token vectors emb (N_packed, P), through the token
        cache. Its bits depend on the order of calls (the cache keeps the vectors of the batch that first had a
        token): calls in a fixed order, then forward_tokens(..., prepared=) on any thread, give the same vectors
        as calls one after another (inference).

        Host data in, one copy: uniq, index and lengths on the host (CPU tensors, as ElmoEmbedder.batch_inputs
        gives them) are looked up in the token cache and laid out there, and what the device needs (the char ids
        of the tokens not cached, the index maps) goes to the model's device in ONE host-to-device copy. uniq and
        index already on the device also work (index is then read back to the host: a sync).

        lanes: sentences laid end to end in the LSTMs' lanes (PackedBatch): faster where a batch's lengths differ,
        for sentences that all start from the same state (stateless, warm); forward_tokens then returns no state."""
        B, T = index.shape
        device = next(self.parameters()).device
        cache = self.__dict__.get("token_cache")
        cache = None if torch.is_grad_enabled() else cache
        on_host = uniq.device.type == "cpu"
        keys, missing, hits = cache.lookup(uniq, self.token_encoder, batch_invariant) if cache else (None, [], [])

        def extra(fwd: Tensor) -> dict[str, Tensor]:
            more = {"inverse": index.to("cpu").reshape(B * T)[fwd]}
            if hits:
                more["missing_at"] = torch.tensor(missing, dtype=torch.int64)
                more["hits_at"] = torch.tensor(hits, dtype=torch.int64)
            if on_host and device.type != "cpu":        # only the char ids of tokens not cached travel
                more["uniq"] = uniq[more["missing_at"]] if hits else uniq
            return more

        pb = PackedBatch(lengths, T, device, tokens=True, batch_invariant=batch_invariant, extra=extra, lanes=lanes)
        new = pb.__dict__.pop("uniq", None)
        if new is None:
            new = uniq.index_select(0, pb.missing_at) if hits else uniq
        if cache is None:
            vectors = self.token_encoder(new, batch_invariant)
        else:
            vectors = cache.assemble(keys, missing, hits, new, getattr(pb, "missing_at", None),
                                     getattr(pb, "hits_at", None), self.token_encoder, batch_invariant)
        return pb, vectors.index_select(0, pb.inverse)

    def forward_tokens(self, uniq: Tensor | None, index: Tensor | None, lengths: Tensor | None,
                       state: tuple[Tensor, Tensor] | None = None, batch_invariant: bool = False,
                       layers: Sequence[int] | None = None, prepared: tuple[PackedBatch, Tensor] | None = None,
                       lanes: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The same vectors as forward(), for the real tokens only, without padding or <S> </S>, and without
        building or zero-filling a padded batch (inference, char CNN or word ids alike).

        uniq (U, ...) distinct token inputs sorted as torch.unique(dim=0) sorts them; index (B, T) int64 rows
        of uniq, -1 at padded positions (model.char_ids.distinct_char_ids); lengths (B,), boundaries included.
        Returns layers (L+1, N, 2P), N = sum(lengths - 2): row b's tokens at [offsets[b], offsets[b+1]),
        each layer contiguous; and the state as forward() returns it. batch_invariant: as forward().
        layers: only these layers, ascending, are returned, (len(layers), N, 2P): the others are still
        computed (each feeds the next) but never copied out. prepared: prepare_tokens()'s result for these inputs
        (uniq, index and lengths are then not read). lanes: as prepare_tokens (the state is then None where a
        lane holds several sentences; the same initial state, given or zeros, starts each)."""
        pb, emb = prepared if prepared is not None else self.prepare_tokens(uniq, index, lengths, batch_invariant,
                                                                            lanes)
        B = len(pb.lengths)
        fwd_rows, bwd_rows, n = pb.fwd_rows, pb.bwd_rows, pb.n_tokens
        layers = range(self.opts.n_layers + 1) if layers is None else layers
        out = emb.new_empty(len(layers), n + 2 * B, 2 * emb.shape[-1])   # every row is written
        state = self._run_layers(emb, pb, state, out, fwd_rows, bwd_rows, batch_invariant, layers)
        return out[:, :n], state

    def _run_layers(self, emb: Tensor, pb: PackedBatch, state, out: Tensor, fwd_rows: Tensor, bwd_rows: Tensor,
                    batch_invariant: bool = False, layers: Sequence[int] | None = None):
        """Layer 0 and the LSTM layers over packed token vectors emb (N, P): layer k's forward and backward
        outputs go to out[k] (rows, 2P) at fwd_rows / bwd_rows. Returns the final state in batch-row order.
        batch_invariant: the LSTMs run in a padded packed layout, step t on round_up(n_t, ROW_TILE) rows.
        layers (ascending): only these are written, layers[i] to out[i] (default: all)."""
        B, device = len(pb.lengths), emb.device
        if state is None:
            state = self.zero_state(B, device)
        h0, c0 = state
        P = emb.shape[-1]
        slot = {k: i for i, k in enumerate(range(self.opts.n_layers + 1) if layers is None else layers)}
        if 0 in slot:
            o = out[slot[0]]
            o[:, :P].index_copy_(0, fwd_rows, emb)
            o[:, P:] = o[:, :P]
        h0 = [h0[:, k][:, pb.order] for k in range(self.opts.n_layers)]     # packed row order
        c0 = [c0[:, k][:, pb.order] for k in range(self.opts.n_layers)]
        step_rows, at = None, None
        if batch_invariant and pb.batch_sizes:
            step_rows, at = pb.step_rows, pb.at       # PackedBatch(batch_invariant=True) made them
            x = emb.new_zeros(2, sum(step_rows), P)
            x[0, at], x[1, at] = emb, emb[pb.bwd_from_fwd]

            def pad(s: Tensor) -> Tensor:          # (2, lanes, D) -> (2, step_rows[0], D), zero rows appended
                n = s.shape[1]
                return torch.cat([s, s.new_zeros(2, step_rows[0] - n, s.shape[2])], dim=1) if step_rows[0] > n else s
            h0, c0 = [pad(s) for s in h0], [pad(s) for s in c0]
        else:
            x = torch.stack([emb, emb[pb.bwd_from_fwd]])                          # (2, N, P)
        h_out, c_out = [], []
        for k, (fl, bl) in enumerate(zip(self.forward_layers, self.backward_layers)):
            y, h, c = run_lstm_layers([fl, bl], self._pair_weights(k), self._drop(x), pb.batch_sizes,
                                      h0[k], c0[k], step_rows, pb.resets)
            if self.opts.use_skip_connections and k > 0:
                y.add_(x)          # bilm-tf's ResidualWrapper, on every layer but the first (y is new)
            if k + 1 in slot:
                real = y if at is None else y[:, at]
                out[slot[k + 1], :, :P].index_copy_(0, fwd_rows, real[0])
                out[slot[k + 1], :, P:].index_copy_(0, bwd_rows, real[1])
            h_out.append(h)
            c_out.append(c)
            x = y
        # final states back from packed row order to batch-row order (lanes of several sentences: none)
        inv = pb.inv_order
        if inv is None:
            return None
        return torch.stack(h_out, dim=1)[:, :, inv], torch.stack(c_out, dim=1)[:, :, inv]   # (2, L, B, P|H)
