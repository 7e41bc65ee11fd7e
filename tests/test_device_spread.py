"""model/device.py spreads worker processes over the GPUs of a machine: N real processes on a faked 4-GPU box
(torch.cuda.is_available / device_count patched in each), all holding their claim at once."""
from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from unittest import mock

import pytest
import torch


def _claim(lock_dir: str, barrier, results) -> None:
    import tempfile

    import torch

    from elmo_pipeline.model.device import resolve_device
    tempfile.tempdir = lock_dir                      # claim_gpu's lock files go to the temp dir
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=4):
        dev = resolve_device("cuda", share_gpus=True)
    results.put(str(dev))
    barrier.wait(timeout=60)                         # hold the claim until every process has one


@pytest.mark.slow
@pytest.mark.parametrize("processes, per_gpu", [(4, 1), (8, 2), (6, None)])
def test_processes_spread_over_gpus(tmp_path, processes, per_gpu):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    devices = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    counts = Counter(devices)
    assert set(counts) <= {f"cuda:{i}" for i in range(4)}
    if per_gpu is not None:
        assert sorted(counts.values()) == [per_gpu] * 4, counts
    else:                                            # 6 on 4: two GPUs with 2, two with 1
        assert sorted(counts.values()) == [1, 1, 2, 2], counts


def test_explicit_gpu_and_missing_gpu():
    import torch

    from elmo_pipeline.model.device import resolve_device
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=4):
        assert resolve_device("cuda:3") == torch.device("cuda:3")
        with pytest.raises(RuntimeError, match="only 4 GPU"):
            resolve_device("cuda:4")
