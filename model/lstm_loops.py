"""The LSTM time loops (inference, in place): G layers of equal shapes in lock-step over a packed batch.

Two implementations of the same step, chosen by model/lstm.py (step_loop):
  onednn_loop  CPU: per step and direction one oneDNN linear over [x_t, h_{t-1}] with the gate activations fused;
               the directions side by side in two threads where torch has two.
  bmm_loop     one batched GEMM per step for all G layers (torch.bmm: cuBLAS on a GPU, MKL on a CPU), the input
               projection computed ahead for chunks of steps, the cell eager or (GPU) one compiled kernel.
Both: x (G, N, D_in) packed, time-major, longest first; step t computes step_rows[t] >= batch_sizes[t] rows
(the first batch_sizes[t] are live sequences); h0 (G, rows, P), c0 (G, rows, H); `live` sequences at the start.
Returns y (G, sum(step_rows), P) and each sequence's final h (G, live, P), c (G, live, H) in packed row order.
resets (model.packing.Resets): rows that take h0/c0 again before a step (a new sentence starts in a lane).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
from torch import Tensor

from elmo_pipeline.model import hardware
from elmo_pipeline.model.direction_threads import run_side_by_side, threads_each
from elmo_pipeline.model.row_tile import RowRule, in_pieces, row_rule_of, threads_set

# Rows of the input projection computed at once: (G, rows, 4H) floats of about 2**24 elements
# (64 MB in fp32), so a batch of any size needs bounded memory and each GEMM is still large.
CHUNK_ELEMENTS = 1 << 24

Cell = Callable[[Tensor, Tensor, "float | None", Tensor], "tuple[Tensor, Tensor]"]


def onednn_loop(layers, weights, x, batch_sizes, step_rows, h0, c0, live, resets, invariant=False):
    """Each direction by itself (_onednn_direction), the directions side by side in helper threads where torch has
    a thread for each (model/direction_threads.py). weights: model.lstm.pack_onednn_weights(layers). invariant
    (batch_invariant): each step GEMM called on row counts its row rule checked (model/row_tile.py), at the threads a
    direction runs on."""
    y = x.new_empty(len(layers), sum(step_rows), layers[0].proj_dim)     # every step's h, written in place
    threads = torch.get_num_threads()
    rules = _onednn_rules(layers[0], x.dtype, threads_each(len(layers))) if invariant else None
    finals = run_side_by_side([functools.partial(_onednn_direction, layers[g], weights[g], x[g], batch_sizes,
                                                 step_rows, h0[g], c0[g], live, resets.direction(g), y[g], rules)
                               for g in range(len(layers))])
    if rules is not None:               # a helper's row check may have set torch's process-wide count: the caller's
        torch.set_num_threads(threads)
    return y, torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals])


def _clip(layer) -> tuple[str, list]:
    """The projection's fused post-op: hardtanh at the layer's projection clip, or none."""
    return ("hardtanh", [-layer.proj_clip, layer.proj_clip]) if layer.proj_clip is not None else ("none", [])


def onednn_step_gemms(layer) -> tuple[tuple[str, int, int, str, list, bool], ...]:
    """The oneDNN loop's step GEMMs of a layer shape, as _onednn_direction calls them: (name, K, N, post-op, its
    scalars, whether it adds a bias) for the sigmoid gates i, f, o ([x, h] -> 3H), gate j ([x, h] -> H, tanh) and
    the projection (H -> P, clipped)."""
    H, P, D = layer.dim, layer.proj_dim, layer.w_in.shape[1]
    return (("gates", D + P, 3 * H, "sigmoid", [], True), ("gate j", D + P, H, "tanh", [], True),
            ("projection", H, P, *_clip(layer), False))


def _onednn_rules(layer, dtype: torch.dtype, threads: int) -> tuple[RowRule, RowRule, RowRule]:
    """The row rules (model/row_tile.py) of the oneDNN loop's step GEMMs (onednn_step_gemms), called at `threads`
    threads (a direction's)."""
    return tuple(row_rule_of("onednn", k, n, dtype, attr, *scalars, *(("bias",) if bias else ()), threads=threads)
                 for _, k, n, attr, scalars, bias in onednn_step_gemms(layer))


# Rows of one call of the gate GEMMs where a CPU with AMX-BF16 tiles runs them in bfloat16 (gate_rows): there oneDNN's
# AMX kernel of one call ran the sigmoid gates (1024 -> 12288) at 631 GFLOP/s on 587 rows and 623 on 1,024, in pieces
# of 256 rows at 783 and 713 (gate j: 624 and 624 whole, 708 and 816 in pieces); a step of up to 256 rows stays one
# call. The projection stays whole (839 vs 691 on 587 rows). `python -m benchmarks.onednn_kernels --rows 42 183 587
# 1024 --pieces 128 256` on an Intel Xeon (family 6, model 167), 1 thread, torch 2.13.0 (onednn_kernels_intel_amx.json).
AMX_GATE_ROWS = 256


def gate_rows(dtype: torch.dtype) -> int | None:
    """Rows of one call of the oneDNN loop's gate GEMMs outside batch invariance: AMX_GATE_ROWS for bfloat16 on a
    CPU with AMX-BF16 tiles, else None (each step's rows in one call: the other kinds' measured choice, their bits
    as before)."""
    return AMX_GATE_ROWS if dtype == torch.bfloat16 and "amx_bf16" in hardware.cpu_flags() else None


def _onednn_direction(layer, weights, x, batch_sizes, step_rows, h0, c0, live, resets, y, rules=None):
    """One direction's time loop, written into y (N, P). Per step, gates = act([x_t, h] @ W.T + b) by oneDNN with
    the activations fused (sigmoid for i, f, o; tanh for j), the cell update in place, then the projection with
    its clip fused (hardtanh). Every GEMM reads the step's rows once; nothing of the size of the gates is written
    twice, and the packed weights stream through once per step. x (N, D) packed, h0 (rows, P), c0 (rows, H),
    resets: Resets.direction(g); rules: _onednn_rules (batch_invariant: each GEMM on checked row counts), or None.
    Returns the final h (live, P), c (live, H) in packed row order."""
    linear = torch.ops.mkldnn._linear_pointwise          # onednn.linear's op, called bare in this hot loop
    w_sig, b_sig, w_j, b_j, w_proj = weights
    H, P, D = layer.dim, layer.proj_dim, x.shape[-1]
    cell_clip = layer.cell_clip
    clip = _clip(layer)

    def gates(rows):
        return linear(rows, w_sig, b_sig, "sigmoid", [], "")      # (m, 3H): i, f, o

    def gate_j(rows):
        return linear(rows, w_j, b_j, "tanh", [], "")             # (m, H)

    def project(rows):
        return linear(rows, w_proj, None, *clip, "")              # (m, P)
    xh = x.new_empty(step_rows[0], D + P)                # [x_t, h_{t-1}] of the step's rows
    out = x.new_empty(step_rows[0], H)                   # sigmoid(o) * tanh(c) of the step's rows
    tmp = x.new_empty(step_rows[0], H, dtype=torch.float32)   # _tanh_times' float32 work rows
    piece = gate_rows(x.dtype) if rules is None else None

    def pieces(m):
        return [(a, min(a + piece, m)) for a in range(0, m, piece)] if piece else [(0, m)]
    c = c0.clone()                                       # (rows, H), each step updates its first rows
    h, done_h, done_c, offset = h0, [], [], 0
    for step, (n, m) in enumerate(zip(batch_sizes, step_rows)):
        if n < live:                           # sequences [n:live) have ended: keep their final state
            done_h.append(h[None, n:live])
            done_c.append(c[None, n:live].clone())
            live = n
        xh[:m, :D] = x[offset: offset + m]
        xh[:m, D:] = h[:m]
        if step in resets:
            _reset(xh[:, D:], c, h0, c0, resets.at(step))
        for a, b in pieces(m):                 # rows [a, b): their gates, then their cell (gates still in cache)
            if rules is None:
                sig, j = gates(xh[a:b]), gate_j(xh[a:b])
            else:
                sig, j = in_pieces(gates, xh[a:b], rules[0]), in_pieces(gate_j, xh[a:b], rules[1])
            i, f, o = sig.split(H, dim=1)
            cg = c[a:b].mul_(f).addcmul_(i, j)
            if cell_clip is not None:
                cg.clamp_(-cell_clip, cell_clip)
            _tanh_times(cg, o, out[a:b], tmp[a:b])
        hidden = out[:m]
        if rules is None:
            y[offset: offset + m] = project(hidden)
        else:
            in_pieces(project, hidden, rules[2], out=y[offset: offset + m])
        h, offset = y[offset: offset + m], offset + m
    h_final, c_final = _final_state(h[None], c[None], live, done_h, done_c)
    return h_final[0], c_final[0]


def bmm_loop(layers, weights, x, batch_sizes, step_rows, h0, c0, live, resets, cell: Cell, invariant=False):
    """One batched GEMM per step for all G layers. The input projection is computed for chunks of consecutive
    steps (about CHUNK_ELEMENTS floats each). weights: model.lstm.stack_weights(layers); cell: cell_eager or
    compiled_cell() (cell_for); invariant (batch_invariant): on a CPU, each GEMM called on row counts its row rule
    checked (model/row_tile.py)."""
    first = layers[0]
    G, H, cell_clip, proj_clip = len(layers), first.dim, first.cell_clip, first.proj_clip
    bias, w_in, w_rec, w_proj = weights
    rules = None
    if invariant and x.device.type == "cpu":      # a GPU keeps its calls whole (batch invariance is refused there)
        (D, N4), P = w_in.shape[1:], first.proj_dim
        rules = [row_rule_of(op, k, n, x.dtype) for op, k, n in
                 (("bmm", D, N4), ("addmm", P, N4), ("bmm", H, P))]

    h, c = h0, c0
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
        xw = ws[: G * rows * 4 * H].view(G, rows, 4 * H)
        if rules is None:
            torch.bmm(x[:, offset: offset + rows], w_in, out=xw)
        else:
            in_pieces(lambda part: torch.bmm(part.contiguous(), w_in), x[:, offset: offset + rows], rules[0], out=xw,
                      dim=1)
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
            if rules is None:
                gates.baddbmm_(h, w_rec)
            else:
                cuts = rules[1].cuts(n, h, dim=1)         # decides the rule's threads first
                with threads_set(rules[1].threads):
                    for a, b in cuts:              # each direction a 2-D addmm_, whatever the chunk's layout
                        for g in range(G):
                            gates[g, a:b].addmm_(h[g, a:b], w_rec[g])
            c, out = cell(gates, c, cell_clip, tanh_c[: G * n * H].view(G, n, H))
            if rules is None:
                h = torch.bmm(out, w_proj, out=y[:, base + r - n: base + r])
            else:
                h = in_pieces(lambda part: torch.bmm(part.contiguous(), w_proj), out, rules[2],
                              out=y[:, base + r - n: base + r], dim=1)
            if proj_clip is not None:
                h.clamp_(-proj_clip, proj_clip)
    return y, *_final_state(h, c, live, done_h, done_c)


def _tanh_times(c: Tensor, o: Tensor, out: Tensor, tmp: Tensor) -> Tensor:
    """o * tanh(c) into out, (m, H); tmp: an (>= m, H) float32 buffer. In float32 as o - 2 o / (exp(2c) + 1): torch's
    float32 tanh ran 2 ns an element on the CPU, this 5 ops 1 ns (AMD EPYC Zen 5), within 1.8e-7 of tanh (1 ulp of 1;
    the fixture parity holds); exp, add, reciprocal and addcmul give an element the same bits wherever it falls in
    the tensor (docs/exactness.md), so batch invariance holds too. On the Intel Xeon with AMX it is the slower route
    (1,122 us against 691 at 183 rows, about 2 % of a float32 step: benchmarks/results/cell_ops_intel_amx.json),
    kept there: the float32 vectors keep their bits. Other dtypes: tanh of c converted to float32 in tmp, rounded back,
    times o: the bits of torch's tanh in that dtype (which computes in float32 and rounds), faster than that tanh
    (bfloat16 on the Intel Xeon with AMX: 1,033 us against 1,503, cell_ops_intel_amx.json; tests/test_lstm_loops.py
    checks the bits)."""
    tmp = tmp[: c.shape[0]]
    if c.dtype != torch.float32:
        torch.tanh(tmp.copy_(c), out=tmp)
        return out.copy_(tmp).mul_(o)
    e = torch.mul(c, 2.0, out=tmp).exp_().add_(1.0).reciprocal_()
    return torch.addcmul(o, o, e, value=-2.0, out=out)


def _reset(h: Tensor, c: Tensor, h0: Tensor, c0: Tensor, at: tuple[Tensor, ...]) -> None:
    """In place: h (n, P) and c (n, H) at the rows `at` from h0/c0 (4 kernels, no host sync)."""
    h.index_put_(at, h0[at])
    c.index_put_(at, c0[at])


def _final_state(h: Tensor, c: Tensor, live: int, done_h: list[Tensor], done_c: list[Tensor]):
    """Each sequence's final (h, c) in packed row order: the sequences still live after the last step, then
    those that ended earlier (recorded as they ended, latest first)."""
    h, c = h[:, :live].clone(), c[:, :live].clone()     # h: a view into y, which callers may change in place
    h_final = torch.cat([h, *reversed(done_h)], dim=1) if done_h else h
    c_final = torch.cat([c, *reversed(done_c)], dim=1) if done_c else c
    return h_final, c_final


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


def cell_eager(gates: Tensor, c: Tensor, cell_clip: float | None, out: Tensor) -> tuple[Tensor, Tensor]:
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


def cell_fused(gates: Tensor, c: Tensor, cell_clip: float | None, out: Tensor) -> tuple[Tensor, Tensor]:
    """cell_eager's math out of place, for torch.compile to fuse into one kernel: (c', sigmoid(o) * tanh(c'))."""
    H = c.shape[-1]
    i, f, o = gates[..., : 3 * H].sigmoid().split(H, dim=-1)
    c = f * c + i * gates[..., 3 * H:].tanh()
    if cell_clip is not None:
        c = c.clamp(-cell_clip, cell_clip)
    return c, o * c.tanh()


_COMPILED_CELL: dict[str, Cell] = {}


# Variants the compiled cell is specialised for, each compiled once: dtype (3) x cell clip given or not (2) x c contiguous
# or a view into the gates' rows (2) x one row or several (2), and a few stride guards; torch's default of 8 was
# exceeded by one process running fp32 then bf16 (FailOnRecompileLimitHit on an NVIDIA H200).
CELL_VARIANTS = 64


def compiled_cell() -> Cell:
    """torch.compile of cell_fused, made once per process: one kernel launch a step instead of 7 (GPUs)."""
    if "fn" not in _COMPILED_CELL:
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, CELL_VARIANTS)
        _COMPILED_CELL["fn"] = torch.compile(cell_fused, dynamic=True, fullgraph=True)
    return _COMPILED_CELL["fn"]


def cell_for(device: torch.device, compile_cell: bool) -> Cell:
    """The bmm loop's cell for weights on `device`: compiled_cell() on a GPU when compile_cell, else cell_eager
    (in place, no allocation)."""
    return compiled_cell() if device.type == "cuda" and compile_cell else cell_eager
