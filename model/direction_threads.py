"""The LSTM's two directions side by side on the CPU, each in a helper thread with its share of torch's threads.

At the oneDNN loop's GEMMs of a few dozen rows a step, the forward and the backward direction in two threads of one
intra-op thread each ran faster than both directions one after the other on two threads (model_speed on an AMD EPYC
Zen 5: benchmarks/README.md), and gave the same bits (oneDNN gives a row the same bits at 1 and 2 threads on the
AMD EPYCs measured, docs/exactness.md). A helper sets its own OpenMP thread count once, when it starts; the
caller's thread count is put back at once.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_POOLS: dict[tuple[int, int], list[concurrent.futures.ThreadPoolExecutor]] = {}   # (helpers, threads each)
_LOCK = threading.Lock()


def run_side_by_side(calls: list[Callable[[], T]]) -> list[T]:
    """Each call's result, in order. With several calls and at least as many torch threads, each call runs in a
    helper thread of its own with torch.get_num_threads() // len(calls) intra-op threads, under the caller's grad
    and inference modes; otherwise the calls run one after the other in this thread. An exception in a call is
    raised here once every call has ended."""
    threads, k = torch.get_num_threads(), len(calls)
    if k < 2 or threads < k:
        return [call() for call in calls]
    helpers = _helpers(k, threads_each(k, threads))
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def in_modes(call: Callable[[], T]) -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return call()

    futures = [helper.submit(in_modes, call) for helper, call in zip(helpers, calls)]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def threads_each(k: int, threads: int | None = None) -> int:
    """The intra-op threads each of k calls runs on under run_side_by_side at `threads` torch threads (None: this
    thread's): threads // k in helpers where there are at least k, else all of them, one call after another."""
    threads = threads or torch.get_num_threads()
    return threads // k if k >= 2 and threads >= k else threads


def _helpers(k: int, each: int) -> list[concurrent.futures.ThreadPoolExecutor]:
    """k single-thread executors whose threads run torch ops with `each` intra-op threads (made once, kept)."""
    with _LOCK:
        if (k, each) not in _POOLS:
            caller = torch.get_num_threads()
            pools = [concurrent.futures.ThreadPoolExecutor(1, f"elmo-lstm-direction-{i}", _set_threads, (each,))
                     for i in range(k)]
            for pool in pools:
                pool.submit(lambda: None).result()      # the helper has set its count
            torch.set_num_threads(caller)               # torch's process-wide count back to the caller's
            _POOLS[(k, each)] = pools
        return _POOLS[(k, each)]


def _set_threads(each: int) -> None:
    torch.get_num_threads()            # torch's first call in a thread takes the process-wide count: take it now,
    torch.set_num_threads(each)        # then this thread's own


def _forget_after_fork() -> None:
    global _LOCK
    _POOLS.clear()                     # a forked child has none of the parent's threads,
    _LOCK = threading.Lock()           # and no thread of its own holds the lock


os.register_at_fork(after_in_child=_forget_after_fork)
