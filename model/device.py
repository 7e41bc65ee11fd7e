"""Choosing the device the biLM runs on: the project's one device chooser.

'auto' | 'cpu' | 'cuda' | 'cuda:N' | N (an int: >= 0 a GPU, -1 the CPU). A requested GPU that is missing
is an error, never a silent CPU fallback. With several GPUs, 'auto'/'cuda' give each process of the
machine its own (a per-GPU lock file held for the life of the process).
"""
from __future__ import annotations

import fcntl
import os
import tempfile

import torch

_GPU_LOCKS: list = []   # flock'd files held for the life of the process


def claim_gpu(n_gpus: int, lock_dir: str | None = None) -> int:
    """Index of a GPU no other process on this machine holds (flock per GPU, held until exit).

    Falls back to pid % n_gpus when all are held."""
    lock_dir = lock_dir or tempfile.gettempdir()
    for i in range(n_gpus):
        f = open(os.path.join(lock_dir, f"elmo-pipeline-gpu-{i}.lock"), "w")
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
