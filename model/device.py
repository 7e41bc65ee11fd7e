"""Choosing the device the biLM runs on (the project's one device chooser), and moving data to and from it.

'auto' | 'cpu' | 'cuda' | 'cuda:N' | N (an int: >= 0 a GPU, -1 the CPU). A requested GPU that is missing
is an error, never a silent CPU fallback. With several GPUs, 'auto'/'cuda' give each process of the
machine its own (a per-GPU lock file held for the life of the process).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile

import numpy as np
import torch

logger = logging.getLogger("elmo-pipeline.device")
_GPU_LOCKS: list = []   # flock'd files held for the life of the process

# Where the batch-invariant path's bits are not independent of the batching, it is refused, never run with a
# claim of exactness it cannot keep: on CUDA (cuBLAS picks its GEMM kernels by shape) a sentence's vectors
# differed between batchings by up to 1.2e-6 (fp32, NVIDIA H200, benchmarks/results/gpu_check_NVIDIA_H200_tests.json).
BATCH_INVARIANT_DEVICES = ("cpu",)


def requested_type(device: str | int | torch.device) -> str:
    """The device type a request names ('cpu', 'cuda'), nothing claimed nor checked; 'auto' is what this machine has."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, int) or str(device).lstrip("-").isdigit():
        return "cpu" if int(device) < 0 else "cuda"
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def check_batch_invariant(device: str | int | torch.device) -> None:
    """ValueError (one line) when batch-invariant bits are not kept on the requested device's type
    (BATCH_INVARIANT_DEVICES)."""
    kind = requested_type(device)
    if kind not in BATCH_INVARIANT_DEVICES:
        raise ValueError(f"--batch-invariant runs on a CPU only: on {kind} a sentence's vectors differ "
                         "between batchings (up to 1.2e-6 in fp32 on an NVIDIA H200); run without it, or on a CPU")


def claim_gpu(n_gpus: int, lock_dir: str | None = None, max_per_gpu: int = 64) -> int:
    """Index of the GPU with the fewest processes of this machine (flock'd lock files, held until exit):
    processes fill slot 0 of every GPU, then slot 1, ...; so N processes on G GPUs get ceil(N/G) or
    floor(N/G) each (4 on 4 GPUs: one each; 8: two each). pid % n_gpus past max_per_gpu slots.
    The lock files live in lock_dir (default: the temp dir, $TMPDIR)."""
    lock_dir = lock_dir or tempfile.gettempdir()
    for slot in range(max_per_gpu):
        for i in range(n_gpus):
            name = f"elmo-pipeline-gpu-{i}.lock" if slot == 0 else f"elmo-pipeline-gpu-{i}.{slot}.lock"
            f = open(os.path.join(lock_dir, name), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            _GPU_LOCKS.append(f)
            return i
    return os.getpid() % n_gpus


def resolve_device(device: str | int | torch.device | None, share_gpus: bool = False) -> torch.device:
    """The torch device for a device request. share_gpus: 'auto'/'cuda' on a machine with several GPUs
    claim one no other process holds (pipeline workers); otherwise they mean the current GPU."""
    if device is None or device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = "cuda"
    if isinstance(device, int) or (isinstance(device, str) and device.lstrip("-").isdigit()):
        n = int(device)
        device = "cpu" if n < 0 else f"cuda:{n}"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {str(device)!r} requested but no CUDA GPU is available")
        n = torch.cuda.device_count()
        if dev.index is None and share_gpus and n > 1:
            return torch.device(f"cuda:{claim_gpu(n)}")
        if dev.index is not None and dev.index >= n:
            raise RuntimeError(f"device {str(device)!r} requested but only {n} GPU(s) exist")
    return dev


def host_side():
    """Context for the model's host-side metadata: index maps built from host data (lengths, char ids) on CPU
    tensors, before the batch's one host-to-device copy. These ops are host work, not device launches: any
    active torch dispatch mode (an op counter, FakeTensorMode in the tests) is suspended inside, so fake-device
    tests can run them for real and op counts are device work only. A no-op context when no mode is active."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def upload(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host int64 tensors -> the same tensors on `device` in ONE host-to-device copy (concatenated, split
    there into views). On the CPU: the tensors as they are (no copy)."""
    if device.type == "cpu" or not host:
        return dict(host)
    with host_side():
        shapes = [t.shape for t in host.values()]
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in host.values()])
    dev = flat.to(device, non_blocking=True)
    out, at = {}, 0
    for name, shape in zip(host, shapes):
        n = shape.numel()
        out[name] = dev.narrow(0, at, n).view(shape)
        at += n
    return out


_PINNED = {"refused": False}     # page-locked memory refused once in this process: not asked for again


def to_host(t: torch.Tensor) -> np.ndarray:
    """A result as a float32 numpy array on the host. On the CPU: t itself when float32 (a view, no copy), else its
    float32 copy. On a GPU: copied into page-locked memory from torch's caching host allocator, reused once the array
    is freed, at the link's speed; a new pageable array (`.cpu()`) faults its fresh pages in as the copy lands (NVIDIA
    H200: 1.35 GB/s against 51.9, benchmarks/results/gpu_levers_NVIDIA_H200.json; the embedder 1.37-1.91x faster,
    gpu_profile_NVIDIA_H200.json). The array keeps its block until it is freed; the allocator sizes blocks in powers
    of two and keeps freed ones for reuse (never back to the OS while the process runs), so hold such arrays only
    as long as they are being used (ElmoEmbedder.embed_batch hands out copies). Where page-locked memory is refused,
    one warning, and new pageable arrays from then on."""
    t = t.float()
    if t.device.type == "cpu":
        return t.numpy()
    if not _PINNED["refused"]:
        try:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError as e:   # the host's or a container's limit on locked memory
            _PINNED["refused"] = True
            logger.warning("page-locked host memory refused (%s): results are copied into pageable memory, slower",
                           str(e).splitlines()[0][:200])
        else:
            host.copy_(t)                           # synchronous: the array is complete when returned
            return host.numpy()
    return t.cpu().numpy()
