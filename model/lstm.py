"""The biLM's LSTM layers: parameters in bilm-tf's layout, and the inference step loop behind one interface.

A layer is TF's LSTMCell(num_proj, cell_clip, proj_clip) (LstmProjection). At inference the forward and
backward layers of one depth run together (run_lstm_layers) through a StepLoop, chosen once per device, dtype
and shape from an explicit option, lstm_loop (BiLM.lstm_loop; ElmoEmbedder(lstm_loop=)):
  'onednn'  oneDNN's linear with prepacked weights and fused activations (CPU: faster than MKL's sgemm on
            AMD CPUs, docs/pipeline.md)
  'bmm'     torch.bmm / baddbmm_ for both directions at once (GPUs, and CPUs without oneDNN)
  'auto'    oneDNN on a CPU whose torch has it for the dtype, for layers wide enough (onednn_pays), else bmm.
Under autograd model/padded_forward.py runs the same layers.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from elmo_pipeline.model import onednn
from elmo_pipeline.model.lstm_loops import bmm_loop, cell_for, onednn_loop
from elmo_pipeline.model.packing import NO_RESETS, Resets

LSTM_LOOPS = ("auto", "onednn", "bmm")

# The oneDNN loop makes six linear calls a step, the bmm loop two batched ones: however narrow the layers, a oneDNN
# step cost at least 117 us where a bmm step cost 25 us (1 thread), so for narrow layers bmm is faster. Measured
# per shape and row count (benchmarks/loop_choice.py, results/loop_choice_zen5.json, AMD EPYC Zen 5, family 26,
# AVX-512 + AVX512_BF16): with gate width 4H >= 512 and GEMM input width
# D_in + P >= 64 the oneDNN loop, otherwise bmm, picked the faster loop for 27 of 28 shapes at 40 rows a step
# (the one miss ran 0.83x the faster). A rule of the shape, not a timing at run time: the vectors' bits depend on
# the loop, and every worker and every batching must pick the same one.
ONEDNN_MIN_GATE_WIDTH = 512
ONEDNN_MIN_INPUT_WIDTH = 64


def forget_bias(dim: int) -> Tensor:
    """TF's run-time forget bias over the gate rows (i, j, f, o): 1.0 on f's `dim` rows, else 0: (4 * dim,)."""
    bias = torch.zeros(4 * dim)
    bias[2 * dim: 3 * dim] = 1.0
    return bias


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
        self.register_buffer("forget_bias", forget_bias(dim), persistent=False)
        for w in (self.w_in, self.w_rec, self.w_proj):
            nn.init.xavier_uniform_(w)


def stack_weights(layers: list[LstmProjection]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The G layers' weights stacked for batched GEMMs (the bmm loop), gate columns reordered from TF's
    (i, j, f, o) to (i, f, o, j) so that the three sigmoid gates are one contiguous slice:
    bias with TF's forget bias (G, 1, 4H), w_in (G, D_in, 4H), w_rec (G, P, 4H), w_proj (G, H, P)."""
    H = layers[0].dim
    perm = torch.cat([torch.arange(0, H), torch.arange(2 * H, 4 * H), torch.arange(H, 2 * H)])
    perm = perm.to(layers[0].bias.device)
    return (torch.stack([(l.bias + l.forget_bias)[perm] for l in layers])[:, None],
            torch.stack([l.w_in[perm].t() for l in layers]),
            torch.stack([l.w_rec[perm].t() for l in layers]),
            torch.stack([l.w_proj.t() for l in layers]))


def _side_by_side(a: Tensor, b: Tensor, rows: tuple[slice, ...]) -> Tensor:
    """[a | b] of the row ranges `rows`, stacked: (their rows, a's width + b's), each row written once."""
    out = a.new_empty(sum(r.stop - r.start for r in rows), a.shape[1] + b.shape[1])
    at = 0
    for r in rows:
        torch.cat([a[r], b[r]], dim=1, out=out[at: at + r.stop - r.start])
        at += r.stop - r.start
    return out


def pack_onednn_weights(layers: list[LstmProjection]) -> list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
    """Per layer, oneDNN-prepacked weights for the oneDNN loop, where one GEMM per gate group reads
    [x_t, h_{t-1}] (D_in + P wide): (w_sig (3H, D_in+P) for gates i, f, o, their bias with TF's forget bias (3H,),
    w_j (H, D_in+P), bias_j (H,), w_proj (P, H)), weights in nn.Linear's (out, in) layout."""
    H = layers[0].dim
    sig, j = (slice(0, H), slice(2 * H, 4 * H)), (slice(H, 2 * H),)       # TF's gate order: i, j, f, o
    packed = []
    for l in layers:
        w_in, w_rec = l.w_in.detach(), l.w_rec.detach()
        b = (l.bias + l.forget_bias).detach()
        packed.append((onednn.pack(_side_by_side(w_in, w_rec, sig)), torch.cat([b[r] for r in sig]),
                       onednn.pack(_side_by_side(w_in, w_rec, j)), b[j[0]].contiguous(), onednn.pack(l.w_proj)))
    return packed


@dataclass(frozen=True)
class StepLoop:
    """One way to run the time loop: name ('onednn' | 'bmm'), weights(layers) -> the layers' weights in the form
    run reads, and run (model/lstm_loops.py's contract)."""
    name: str
    weights: Callable[[list[LstmProjection]], object]
    run: Callable[..., tuple[Tensor, Tensor, Tensor]]


def check_loop_choice(choice: str, source: str = "lstm_loop") -> str:
    """choice if it is one of LSTM_LOOPS, else ValueError naming `source` (the option or variable it came from)."""
    if choice not in LSTM_LOOPS:
        raise ValueError(f"{source} must be one of {LSTM_LOOPS}, got {choice!r}")
    return choice


def options_from_env() -> tuple[str, bool]:
    """The defaults of a model's loop options, from the environment when called (BiLM reads them when it is
    constructed): lstm_loop = $ELMO_LSTM_GEMM (else 'auto'), compile_cell = $ELMO_COMPILE_CELL != '0'."""
    return (check_loop_choice(os.environ.get("ELMO_LSTM_GEMM", "auto"), "ELMO_LSTM_GEMM"),
            os.environ.get("ELMO_COMPILE_CELL", "1") != "0")


def onednn_pays(layer: LstmProjection | None) -> bool:
    """Whether the oneDNN loop is the faster for layers of this shape (None: a wide one): gate width 4H >=
    ONEDNN_MIN_GATE_WIDTH and GEMM input width D_in + P >= ONEDNN_MIN_INPUT_WIDTH."""
    if layer is None:
        return True
    H, P, D = layer.dim, layer.proj_dim, layer.w_in.shape[1]
    return 4 * H >= ONEDNN_MIN_GATE_WIDTH and D + P >= ONEDNN_MIN_INPUT_WIDTH


def loop_name(device: torch.device, dtype: torch.dtype, choice: str = "auto",
              layer: LstmProjection | None = None) -> str:
    """The loop step_loop() runs ('onednn' | 'bmm') for this device, dtype, choice (one of LSTM_LOOPS) and layer
    shape (onednn_pays; None: a wide one); what model/kernels.py records."""
    if check_loop_choice(choice) == "auto":
        return "onednn" if onednn_pays(layer) and onednn.runs(device, dtype) else "bmm"
    return choice


def step_loop(device: torch.device, dtype: torch.dtype, choice: str = "auto", compile_cell: bool = True,
              layer: LstmProjection | None = None) -> StepLoop:
    """The loop for weights on this device and dtype. choice: one of LSTM_LOOPS; compile_cell: the bmm loop's cell
    as one compiled kernel on a GPU (model.lstm_loops.cell_for); layer: one of the layers it runs, whose shape
    'auto' weighs (onednn_pays; None: a wide one)."""
    if loop_name(device, dtype, choice, layer) == "onednn":
        if device.type != "cpu":
            raise ValueError(f"the onednn LSTM loop runs on a CPU only, not on {device.type}: use bmm or auto")
        return StepLoop("onednn", pack_onednn_weights, onednn_loop)
    return StepLoop("bmm", stack_weights, functools.partial(bmm_loop, cell=cell_for(device, compile_cell)))


def run_lstm_layers(loop: StepLoop, layers: list[LstmProjection], weights, x: Tensor, batch_sizes: list[int],
                    h0: Tensor, c0: Tensor, step_rows: list[int] | None = None, resets: Resets | None = None):
    """Run G independent LSTM layers of equal shapes in lock-step (e.g. the forward and the backward
    direction, which share the packed step sizes). Inference only (in place, no autograd);
    model/padded_forward.py is the path under autograd.

    loop: step_loop()'s choice; weights: loop.weights(layers). x (G, N, D_in) packed; h0 (G, B, P), c0 (G, B, H)
    in packed row order. Returns outputs (G, N, P) and final states h (G, B, P), c (G, B, H).

    step_rows (batch_invariant): rows computed at each step, >= batch_sizes[t] and non-increasing (a padded
    packed layout: step t's first batch_sizes[t] rows are the live sequences, the rest are computed and their
    outputs are junk). x, the outputs and h0/c0 then have step_rows rows per step / step_rows[0] rows; the final
    states are still each sequence's own, taken when it ends: the batch_sizes[0] sequences of step 0.

    resets (lanes, PackedBatch.resets): before a step, the rows of the layers it names take their state
    from h0/c0 again (a new sentence starts in that lane).
    """
    if not batch_sizes:
        return x.new_empty(len(layers), 0, layers[0].proj_dim), h0, c0
    invariant = step_rows is not None
    live = h0.shape[1] if step_rows is None else batch_sizes[0]     # unpadded: length-0 rows end before step 0
    step_rows = batch_sizes if step_rows is None else step_rows
    return loop.run(layers, weights, x, batch_sizes, step_rows, h0, c0, live, NO_RESETS if resets is None else resets,
                    invariant=invariant)
