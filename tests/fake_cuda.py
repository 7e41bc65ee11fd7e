"""Counting what a forward pass would do on a GPU, without one: dispatched ops (kernel launches), host<->device
copies and host syncs, on fake CUDA tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data).

    with fake_cuda() as dev:                    # dev = torch.device("cuda:0"), fake
        model = to_fake(model, dev)             # parameters and buffers become fake CUDA tensors
        with OpCounter(model) as n:
            model(...)                          # a device mismatch raises FakeTensorDeviceMismatchError,
        n.launches, n.h2d, n.d2h, n.by_region   # a host sync DataDependentOutputException / DynamicOutputShapeException

On a CPU-only torch build, Python indexing of a CUDA tensor (x[1:3], x[idx] = y) asks for a CUDA device guard
that such a build lacks; `fake_cuda` then routes Tensor.__getitem__/__setitem__ of fake CUDA tensors to the
aten ops they stand for (slice, select, unsqueeze, index, index_put_), which is what they dispatch on a GPU.
Host-side work (model.device.host_side) suspends every dispatch mode: it runs for real and is not counted.
Used by tests/test_fake_cuda.py.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import elmo_pipeline.model.bilm as bilm
import elmo_pipeline.model.lstm_loops as lstm_loops
from elmo_pipeline.model.lstm_loops import Cell, cell_eager

aten = torch.ops.aten
DEVICE = torch.device("cuda:0")   # an explicit index: torch.device("cuda") would ask a CPU build for the current GPU

# ops that allocate or re-view memory without running a kernel
NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "lift_fresh",
             "_local_scalar_dense", "device"}


_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
              torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.bool: np.bool_}


def _fake_cuda_tensor(x) -> bool:
    return isinstance(x, FakeTensor) and x.device.type == "cuda"


def _expand(x: torch.Tensor, idx) -> list:
    idx = list(idx) if isinstance(idx, tuple) else [idx]
    used = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
               for i in idx if i is not None and i is not Ellipsis)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx[k: k + 1] = [slice(None)] * (x.dim() - used)
    return idx


def _basic(x: torch.Tensor, idx) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Apply the basic part of a Python index (ints, slices, None, ...) as aten views; return the view and the
    advanced (tensor) indices by dimension of the view."""
    dim, adv = 0, {}
    for i in _expand(x, idx):
        if i is None:
            x, dim = aten.unsqueeze.default(x, dim), dim + 1
        elif isinstance(i, bool):
            raise NotImplementedError("bool scalar index")
        elif isinstance(i, int):
            x = aten.select.int(x, dim, i)
        elif isinstance(i, slice):
            x = aten.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            dim += 1
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=x.device)
            adv[dim] = t
            dim += t.dim() if t.dtype == torch.bool else 1
    return x, adv


def _to_cuda(args, kwargs) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(isinstance(a, (torch.device, str)) and torch.device(a).type == "cuda" for a in targets if a is not None
               and not isinstance(a, torch.dtype))


def _indices(adv: dict[int, torch.Tensor]) -> list:
    return [adv.get(d) for d in range(max(adv) + 1)]


class _IndexAsAten(TorchFunctionMode):
    """Tensor.__getitem__ / __setitem__ of fake CUDA tensors as the aten ops they dispatch (see module doc);
    and a real host tensor's .to(a CUDA device) as its fake twin's (FakeTensorMode cannot convert a real
    input under inference_mode on a CPU-only build: it tries a real CUDA allocation)."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.conv1d, torch.nn.functional.conv1d) and _fake_cuda_tensor(args[0]):
            # a CPU build cannot pick a CUDA convolution backend, even for fake tensors: a result of the right
            # shape stands in (the training forward's char CNN; one uncounted launch per filter width)
            x, w = args[0], args[1]
            stride, padding, dilation = (int(v[0]) if isinstance(v, (tuple, list)) else int(v)
                                         for v in (list(args[3:]) + [1, 0, 1][len(args[3:]):])[:3])
            k = w.shape[-1]
            n = (x.shape[-1] + 2 * padding - dilation * (k - 1) - 1) // stride + 1
            return x.new_empty(x.shape[0], w.shape[0], n).requires_grad_(x.requires_grad or w.requires_grad)
        if func is torch.Tensor.numpy and isinstance(args[0], FakeTensor) and args[0].device.type == "cpu":
            # results copied back to the host (the copy is dispatched and counted): zeros stand for their values
            return np.zeros(tuple(args[0].shape), dtype=_NP_DTYPES[args[0].dtype])
        if func is torch.Tensor.to and type(args[0]) is torch.Tensor and _to_cuda(args[1:], kwargs):
            return self.mode.from_tensor(args[0]).to(*args[1:], **kwargs)
        if func is torch.Tensor.__getitem__ and _fake_cuda_tensor(args[0]):
            x, adv = _basic(*args)
            return aten.index.Tensor(x, _indices(adv)) if adv else x
        if func is torch.Tensor.__setitem__ and _fake_cuda_tensor(args[0]):
            x, adv = _basic(args[0], args[1])
            value = args[2]
            if adv:
                if not isinstance(value, torch.Tensor):
                    value = torch.full((), value, dtype=x.dtype, device=x.device)
                aten.index_put_.default(x, _indices(adv), value)
            elif isinstance(value, torch.Tensor):
                aten.copy_.default(x, value)
            else:
                aten.fill_.Scalar(x, value)
            return None
        return func(*args, **kwargs)


_COUNTERS: list = []     # the OpCounters active now, innermost last


def _fused_cell() -> Cell:
    """What model.lstm_loops.compiled_cell() returns inside fake_cuda(): torch.compile's one fused kernel, which fake
    tensors cannot be compiled into here. Runs cell_eager uncounted and counts one launch. The real dispatch
    (model.lstm_loops.cell_for: a GPU and compile_cell) decides when it is called."""

    def fused(gates, c, cell_clip, out):
        counter = _COUNTERS[-1] if _COUNTERS else None
        if counter is None:
            return cell_eager(gates, c, cell_clip, out)
        counter.ops["fused LSTM cell (torch.compile)"] += 1
        counter.by_region[counter.region] += 1
        counter.silent = True
        try:
            return cell_eager(gates, c, cell_clip, out)
        finally:
            counter.silent = False
    return fused


@contextlib.contextmanager
def fake_cuda() -> Iterator[torch.device]:
    """FakeTensorMode with fake CUDA tensors (real host tensors allowed as inputs: they become fake constants).
    Yields the fake device (cuda:0). model.lstm_loops.compiled_cell is stood in for (_fused_cell)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shim = _IndexAsAten(mode) if not torch.backends.cuda.is_built() else contextlib.nullcontext()
    stand_in = _fused_cell()
    with mock.patch.object(lstm_loops, "compiled_cell", lambda: stand_in), mode, shim:
        yield DEVICE


def to_fake(module: torch.nn.Module, device: torch.device = DEVICE) -> torch.nn.Module:
    """The module's parameters and buffers replaced in place by fake tensors of the same shapes and dtypes on
    `device` (inside fake_cuda()). Values are not kept: fake tensors have none."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                fake = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
                m._parameters[name] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
    module.__dict__.pop("_weight_cache", None)
    return module


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: launches (ops that run a kernel: not views, not bare
    allocations), by region, and the copies between host and device. Regions: 'encoder' (the token encoder),
    'lstm' (model.lstm.run_lstm_layers, as model.bilm calls it), 'other' (everything else); given a model, its
    token encoder and the LSTM loop are wrapped for the time of the count."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.model = model
        self.ops: Counter = Counter()
        self.by_region: Counter = Counter()
        self.views = 0
        self.h2d = self.d2h = 0
        self.h2d_bytes = self.d2h_bytes = 0
        self.region = "other"
        self.silent = False
        self._undo: list = []

    @property
    def launches(self) -> int:
        return sum(self.by_region.values())

    @contextlib.contextmanager
    def _in(self, region: str):
        old, self.region = self.region, region
        try:
            yield
        finally:
            self.region = old

    def _wrap(self, owner, name: str, region: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        counter = self

        def wrapped(*a, **k):
            with counter._in(region):
                return fn(*a, **k)
        had = name in vars(owner) if not isinstance(owner, type) else True
        setattr(owner, name, wrapped)
        self._undo.append((owner, name, fn, had))

    def __enter__(self):
        _COUNTERS.append(self)
        if self.model is not None:
            self._wrap(bilm, "run_lstm_layers", "lstm")
            enc = getattr(self.model, "token_encoder", None)
            if enc is not None:
                self._wrap(enc, "forward", "encoder")
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, fn, had in reversed(self._undo):
            if isinstance(owner, torch.nn.Module) and not had:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._undo.clear()
        _COUNTERS.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.silent:
            return out
        name = func.overloadpacket.__name__
        if name in ("to", "_to_copy", "copy_"):
            src, dst = (args[1], args[0]) if name == "copy_" else (args[0], out)
            if src.device.type == "cpu" and dst.device.type != "cpu":
                self.h2d, self.h2d_bytes = self.h2d + 1, self.h2d_bytes + src.numel() * src.element_size()
            elif src.device.type != "cpu" and dst.device.type == "cpu":
                self.d2h, self.d2h_bytes = self.d2h + 1, self.d2h_bytes + src.numel() * src.element_size()
            if name == "to" and out is args[0]:        # nothing to convert: no copy
                self.views += 1
                return out
        if func.is_view or name in NO_KERNEL:
            self.views += 1
        else:
            self.ops[name] += 1
            self.by_region[self.region] += 1
        return out

    def report(self) -> dict:
        return {"launches": self.launches, "by_region": dict(self.by_region), "views_and_allocs": self.views,
                "h2d_copies": self.h2d, "h2d_bytes": self.h2d_bytes, "d2h_copies": self.d2h,
                "d2h_bytes": self.d2h_bytes, "top_ops": dict(self.ops.most_common(12))}


def fake_model(config: str = "original", device: torch.device = DEVICE):
    """A BiLM of a PUBLISHED_OPTIONS shape (model/synthetic.py) with fake parameters on `device` (inside
    fake_cuda()): built on the meta device, so no memory and no init time. model.w_device is `device`."""
    import copy
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.model.options import parse_options
    from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
    with torch.device("meta"):
        model = BiLM(parse_options(copy.deepcopy(PUBLISHED_OPTIONS[config])))
    model = to_fake(model, device).eval()
    model.w_device = device
    return model
