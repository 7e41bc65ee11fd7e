"""oneDNN's linear on the CPU: the GEMM library of the LSTM step (model/lstm_loops.py: onednn_loop) and the token
encoder (model/encoders.py) wherever it runs the dtype natively. On the AMD EPYCs measured it runs 2.2x MKL's fp32
GEMM (benchmarks/README.md); the batch-invariant path calls it on row counts checked to keep a row's bits
(model/row_tile.py).

Weights are prepacked once into oneDNN's blocked layout (pack) and cached by their owner, re-packed when a
parameter changes (params_key); linear(x, packed, bias, act) is x @ W.T + bias with an activation fused.
"""
from __future__ import annotations

import torch
from torch import Tensor


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN runs this dtype natively here (a CPU whose torch build has it)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    supported = {torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    return supported.get(dtype, False)


def pack(weight: Tensor) -> Tensor:
    """A (out, in) weight, as nn.Linear keeps it, in oneDNN's blocked layout for linear()."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None, act: str = "none",
           scalars: list | tuple = ()) -> Tensor:
    """act(x @ W.T + bias): x (M, in), packed = pack(W (out, in)) -> (M, out). act: 'none', 'sigmoid', 'tanh',
    'relu' or 'hardtanh' (scalars [min, max])."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.detach(), act, list(scalars), "")


def params_key(params) -> tuple:
    """What identifies the current values of these parameters: storage, in-place version, dtype and device each
    (the key of the packed-weight caches here and of BiLM's loop weights)."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
