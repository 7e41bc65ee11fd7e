"""What this machine's hardware does natively with the biLM's compute dtypes: the one place that tells.

A CPU runs bfloat16 GEMMs natively with AVX512_BF16 or AMX-BF16 (x86) or FEAT_BF16 (aarch64 `bf16`);
without them torch emulates bf16 (convert, fp32 arithmetic, convert back): slower than float32. float16
likewise needs AVX512_FP16 or AMX-FP16. A CUDA GPU runs bf16 natively from compute capability 8.0 (Ampere).
CPU features come from /proc/cpuinfo (Linux); elsewhere they are unknown and no verdict is claimed.

Used by `elmo-pipeline doctor` (report()), the pipeline's manifest (compute_support(): the `compute_support`
key) and the embedder (warn_if_emulated(): one logging.warning per process for an emulated dtype).
"""
from __future__ import annotations

import functools
import logging
import os
import platform

import torch

CPUINFO = "/proc/cpuinfo"
# CPU flags that matter for the biLM's GEMMs, as /proc/cpuinfo spells them (x86 'flags', aarch64 'Features')
X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx512_vnni", "avx_vnni")
ARM_FLAGS = ("asimd", "sve", "bf16", "i8mm")
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"), "float16": ("avx512_fp16", "amx_fp16")}
NATIVE, EMULATED, UNKNOWN = "native", "emulated", "unknown"
_WARNED: set = set()        # dtypes warned about in this process
logger = logging.getLogger("elmo-pipeline.hardware")


def cpu_info(text: str | None = None) -> dict:
    """The CPU as /proc/cpuinfo describes it (text: its contents; None reads the file): arch (this machine's),
    vendor, family, model, name, `flags_checked` (X86_FLAGS or ARM_FLAGS) and `flags` (those it has; None where
    unknown)."""
    if text is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return {"arch": platform.machine(), "vendor": None, "family": None, "model": None,
                    "name": platform.processor() or None, "flags": None, "flags_checked": []}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break          # the first processor's block describes them all
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    checked = X86_FLAGS if "flags" in fields else ARM_FLAGS if "features" in fields else ()
    have = set((fields.get("flags") or fields.get("features") or "").split())
    return {"arch": platform.machine(), "vendor": fields.get("vendor_id") or fields.get("cpu implementer"),
            "family": _int(fields.get("cpu family")), "model": _int(fields.get("model", fields.get("cpu part"))),
            "name": fields.get("model name") or None, "flags": [f for f in checked if f in have] if checked else None,
            "flags_checked": list(checked)}


@functools.cache
def cpu_flags() -> frozenset:
    """This CPU's flags of X86_FLAGS / ARM_FLAGS (cpu_info()), read once per process; empty where unknown."""
    return frozenset(cpu_info().get("flags") or ())


def _int(s: str | None) -> int | None:
    try:
        return int(s, 16) if s.lower().startswith("0x") else int(s)
    except (AttributeError, ValueError):
        return None


def cpu_support(dtype: str, cpu: dict) -> str:
    """'native' | 'emulated' | 'unknown': how a CPU (cpu_info()) runs GEMMs in `dtype` (a COMPUTE_DTYPES name)."""
    if dtype == "float32":
        return NATIVE
    decisive = native_flags(dtype, cpu)
    if cpu.get("flags") is None or not decisive:
        return UNKNOWN
    return NATIVE if any(f in cpu["flags"] for f in decisive) else EMULATED


def native_flags(dtype: str, cpu: dict) -> list[str]:
    """The flags of cpu's architecture that would make `dtype` native (none: this module cannot tell)."""
    return [f for f in NATIVE_FLAGS.get(dtype, ()) if f in cpu.get("flags_checked", ())]


def cuda_devices() -> list[dict]:
    """Each visible CUDA GPU: index, name, compute capability and its bf16 support (native from 8.0)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        out.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}",
                    "bfloat16": NATIVE if major >= 8 else EMULATED})
    return out


def compute_support(dtype: str, device: str | torch.device, cpu: dict | None = None) -> dict:
    """How `device` runs the biLM in `dtype`: {"dtype", "device", "support": native|emulated|unknown, "cpu" or
    "gpu": what it was judged on}. The manifest's `compute_support` entry."""
    dev = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if dev.type == "cuda":
        i = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(i)
        native = name in ("float32", "float16") or major >= 8
        return {"dtype": name, "device": str(dev), "support": NATIVE if native else EMULATED,
                "gpu": {"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"}}
    cpu = cpu_info() if cpu is None else cpu
    return {"dtype": name, "device": "cpu", "support": cpu_support(name, cpu) if dev.type == "cpu" else UNKNOWN,
            "cpu": cpu}


def warn_if_emulated(dtype: str | torch.dtype, device: str | torch.device) -> bool:
    """One logging.warning per process and dtype when the CPU emulates `dtype` (slower than float32). True if
    it warned now."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32" or torch.device(device).type != "cpu" or name in _WARNED:
        return False
    cpu = cpu_info()
    if cpu_support(name, cpu) != EMULATED:
        return False
    _WARNED.add(name)
    need = " or ".join(native_flags(name, cpu))
    logger.warning("compute dtype %s on a CPU without native %s (no %s): emulated, slower than float32; "
                   "--compute-dtype float32 is faster here (`elmo-pipeline doctor` shows the CPU's support)",
                   name, name, need)
    return True


def verdict(support: str) -> str:
    return {NATIVE: "native", EMULATED: "emulated (slower than float32)", UNKNOWN: "unknown"}[support]


def report() -> dict:
    """Everything `elmo-pipeline doctor` shows: versions, CPU, torch's CPU capability, GPUs, dtype verdicts."""
    cpu = cpu_info()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = None
    gpus = cuda_devices()
    return {"python": platform.python_version(), "torch": torch.__version__, "os": platform.platform(),
            "cores": os.cpu_count(), "cpu": cpu, "torch_cpu_capability": capability,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
            "cuda": gpus, "default_device": "cuda:0" if gpus else "cpu",
            "cpu_support": {d: cpu_support(d, cpu) for d in ("float32", "bfloat16", "float16")}}
