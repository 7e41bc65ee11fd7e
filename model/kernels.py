"""What computes a run's vectors, as a record: the kernel path (docs/exactness.md#kernel-path).

Two runs of the same model, settings and tokens give the same bits only on the same kernel path: the LSTM loop
(model/lstm.py loop_name), the GEMM library's CPU kernel class (ISA, vendor and core; oneDNN's and MKL's ISA caps),
torch's, oneDNN's and MKL's versions, the math modes (oneDNN's default fpmath mode, torch's float32 matmul
precision, TF32 on a GPU), the torch thread count, the compute and stored dtypes and the batch-invariant row rule.
kernel_path() is that record (JSON-able; the manifest's `kernel_path`), kernel_difference() the first field two
records differ in, as a phrase (None: the same path). Workers of a --batch-invariant run check their own record
against the planned one (model.resolve.ModelSpec.check_kernel_path); --reuse compares a source's
(pipeline/reuse_sources.py).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re

import torch

from elmo_pipeline.model import onednn, row_tile
from elmo_pipeline.model.hardware import cpu_info
from elmo_pipeline.model.lstm import LstmProjection, loop_name, options_from_env

# Fields recorded for people, not compared: a CPU's marketing name (the core is its vendor, family and model,
# and the ISA flags; SKUs of one core differ in clocks, core count and L3, which no kernel choice here reads).
INFORMATIONAL = {("cpu", "name")}
# Labels of the fields in kernel_difference's phrase (dotted path -> words)
LABELS = {"lstm_loop": "LSTM loop", "lstm_cell": "LSTM cell", "encoder_gemm": "token encoder GEMM",
          "device": "device", "torch_threads": "torch threads", "row_rule": "batch-invariant row rule",
          "cpu": "CPU", "gpu": "GPU", "math.onednn_fpmath_mode": "ONEDNN_DEFAULT_FPMATH_MODE",
          "cpu.onednn_max_cpu_isa": "ONEDNN_MAX_CPU_ISA", "cpu.torch_capability": "torch CPU capability",
          "math.float32_matmul_precision": "torch float32 matmul precision"}


def kernel_path(compute_dtype: str, device: str | torch.device, output_dtype: str = "float32", *, model=None,
                opts=None, batch_invariant: bool = False, torch_threads: int | None = None) -> dict:
    """The kernel path of a biLM run here: `model` (a BiLM: its lstm_loop and compile_cell options and its layers'
    shapes) or, without one, the environment's loop options (as a BiLM built here takes them) and the layer shapes
    of `opts` (model.options.BiLMOptions; None: wide layers), in compute_dtype on `device`, stored as output_dtype;
    torch_threads: each worker's intra-op threads (None: this process's)."""
    dev = torch.device(device)
    dtype = getattr(torch, str(compute_dtype).removeprefix("torch."))
    choice, compile_cell = (model.lstm_loop, model.compile_cell) if model is not None else options_from_env()
    layers = list(model.forward_layers) if model is not None else shape_layers(opts) if opts is not None else [None]
    loops = [loop_name(dev, dtype, choice, layer) for layer in layers]
    cpu = dev.type == "cpu"
    return {"lstm_loop": loops,
            "lstm_cell": "compiled" if dev.type == "cuda" and compile_cell and "bmm" in loops else "eager",
            "encoder_gemm": "onednn" if onednn.runs(dev, dtype) else "torch",
            "device": dev.type,
            "cpu": cpu_kind() if cpu else None,
            "gpu": gpu_kind(dev) if dev.type == "cuda" else None,
            "torch_threads": (torch_threads or torch.get_num_threads()) if cpu else None,
            "versions": versions(dev),
            "math": math_modes(dev),
            "dtypes": {"compute": str(dtype).removeprefix("torch."), "output": output_dtype},
            "row_rule": row_rule() if batch_invariant else None}


def shape_layers(opts) -> list:
    """One direction's LSTM layers of a BiLMOptions as BiLM builds them (P -> H -> P each), on the meta device:
    their shapes for model.lstm.loop_name, no memory."""
    P, H = opts.projection_dim, opts.lstm_dim
    with torch.device("meta"):
        return [LstmProjection(P, H, P, opts.cell_clip, opts.proj_clip) for _ in range(opts.n_layers)]


def embedder_kernel_path(embedder, output_dtype: str) -> dict:
    """kernel_path() of a model.embedder.ElmoEmbedder as it runs in this process (a pipeline worker's)."""
    return kernel_path(str(embedder.dtype), embedder.device, output_dtype, model=embedder.model,
                       batch_invariant=embedder.batch_invariant)


def row_rule() -> dict:
    """The batch-invariant path's row rule: a row has the bits a ROW_TILE-row GEMM call gives it (model/row_tile.py)."""
    return row_tile.row_rule()


def cpu_kind() -> dict:
    """The CPU kernel class: vendor, family, model and ISA flags (/proc/cpuinfo: model.hardware.cpu_info), torch's
    dispatch capability, and the ISA caps a process may set (oneDNN's, MKL's) as given (None: unset)."""
    cpu = cpu_info()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = None
    return {"vendor": cpu["vendor"], "family": cpu["family"], "model": cpu["model"], "arch": cpu["arch"],
            "flags": cpu["flags"], "torch_capability": capability,
            "onednn_max_cpu_isa": _env("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", unset=("ALL",)),
            "mkl_cbwr": _env("MKL_CBWR"), "mkl_enable_instructions": _env("MKL_ENABLE_INSTRUCTIONS"),
            "name": cpu["name"]}


def gpu_kind(dev: torch.device) -> dict:
    """A CUDA GPU's name and compute capability (cuBLAS picks its kernels by both)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(i)
    return {"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"}


def versions(dev: torch.device) -> dict:
    """torch's version and those of the GEMM libraries it was built with (oneDNN, MKL; CUDA and cuDNN on a GPU)."""
    built = _build_versions()
    out = {"torch": torch.__version__, "onednn": built["onednn"], "mkl": built["mkl"]}
    if dev.type == "cuda":
        out.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return out


@functools.lru_cache(maxsize=1)
def _build_versions() -> dict:
    """oneDNN's and MKL's versions as torch.__config__.show() names them (None where it names none)."""
    text = torch.__config__.show()
    onednn_v = re.search(r"(?:MKL-DNN|oneDNN)\s+v?([0-9][\w.]*)", text)
    mkl_v = re.search(r"Math Kernel Library Version\s+([0-9][\w.]*)", text)
    return {"onednn": onednn_v.group(1) if onednn_v else None, "mkl": mkl_v.group(1) if mkl_v else None}


def math_modes(dev: torch.device) -> dict:
    """The math modes that let a float32 GEMM round in lower precision: oneDNN's default fpmath mode (its
    environment variable; unset is 'strict'), torch's float32 matmul precision and oneDNN float32 precision; on a
    GPU, TF32 and reduced-precision reductions."""
    out = {"onednn_fpmath_mode": (_env("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE") or "STRICT").lower(),
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "onednn_fp32_precision": _flag(lambda: torch.backends.mkldnn.matmul.fp32_precision)}
    if dev.type == "cuda":
        m = torch.backends.cuda.matmul
        out.update(cuda_matmul_tf32=m.allow_tf32, cudnn_tf32=torch.backends.cudnn.allow_tf32,
                   bf16_reduced_reduction=_flag(lambda: m.allow_bf16_reduced_precision_reduction),
                   fp16_reduced_reduction=_flag(lambda: m.allow_fp16_reduced_precision_reduction))
    return out


def _flag(get):
    """A torch setting's value, None where this torch has no such setting."""
    try:
        value = get()
    except (AttributeError, RuntimeError):
        return None
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _env(*names: str, unset: tuple[str, ...] = ()) -> str | None:
    """The first of these environment variables set (upper case; a value in `unset` counts as unset)."""
    for name in names:
        value = os.environ.get(name, "").strip().upper()
        if value:
            return None if value in unset else value
    return None


def kernel_key(record: dict) -> str:
    """What names the path of a record (formats.layout.well_formed_kernel): canonical JSON without its INFORMATIONAL
    fields (records of one key are one path: kernel_difference finds no difference)."""
    record = copy.deepcopy(record)
    for *parents, leaf in INFORMATIONAL:
        at = _at(record, tuple(parents))
        if isinstance(at, dict):
            at.pop(leaf, None)
    return json.dumps(record, sort_keys=True)


def kernel_difference(a: dict, b: dict) -> str | None:
    """A phrase naming the first field where the kernel paths a and b differ (and how many others do), None when
    they are the same path; INFORMATIONAL fields are not compared."""
    differ = _differences(a, b, ())
    if not differ:
        return None
    first = differ[0]
    more = f" (and {len(differ) - 1} other field{'s' if len(differ) > 2 else ''})" if len(differ) > 1 else ""
    return f"{_label(first)} {_show(_at(a, first))} vs {_show(_at(b, first))}{more}"


def _differences(a, b, path: tuple) -> list[tuple]:
    """The paths of the leaves (or of a dict on one side only) where a and b differ, the likelier causes first."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if a == b or path in INFORMATIONAL else [path]
    out = []
    for k in sorted(set(a) | set(b), key=_order):
        out += _differences(a.get(k), b.get(k), (*path, k))
    return out


def _at(record, path: tuple):
    for k in path:
        record = record.get(k) if isinstance(record, dict) else None
    return record


_FIRST = ("lstm_loop", "device", "math", "dtypes", "cpu", "gpu", "versions")    # the likelier causes named first


def _order(key: str) -> tuple:
    return (_FIRST.index(key) if key in _FIRST else len(_FIRST), str(key))


def _label(path: tuple) -> str:
    dotted = ".".join(path)
    return LABELS.get(dotted) or " ".join(path).replace("_", " ")


def _show(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={_show(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "/".join(map(str, value)) if value else "none"
    return "none" if value is None else str(value)


def planned_kernel_path(spec, bilm, local: bool) -> dict | None:
    """The kernel path a local run's workers compute on (they run here, in this environment): spec's compute dtype
    on the device they pick, `bilm`'s loop options and layer shapes (None: not built here; the environment's options
    and the shapes of spec's options file), spec's stored dtype, torch threads and batch invariance (spec: a
    model.resolve.ModelSpec). None on a remote runner: its machines are not known here."""
    if not local:
        return None
    from elmo_pipeline.model.device import resolve_device
    from elmo_pipeline.model.options import load_options
    opts = load_options(spec.local_files()[0]) if bilm is None else None
    return kernel_path(spec.compute_dtype, resolve_device(spec.device), spec.dtype, model=bilm, opts=opts,
                       batch_invariant=spec.batch_invariant, torch_threads=spec.torch_threads or None)


def exact_here(record: dict | None, batch_invariant: bool) -> bool:
    """Whether a sentence's vectors are a function of its tokens down to the bit on this kernel path (what --dedupe's
    manifest entry claims as `exact`): batch-invariant on a CPU, where every GEMM of the run is called only on row
    counts its per-process check kept (model/row_tile.py RowRule), whatever the kind, ISA cap or math mode. record
    None (a remote runner's: its workers each check their device): batch_invariant."""
    if not batch_invariant or record is None:
        return batch_invariant
    return record.get("device") == "cpu"
