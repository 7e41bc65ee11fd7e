"""A worker process's exit waits for the steps' work under way in its threads (a bounded wait). No Beam import.

A runner's worker threads are daemons (Beam's SDK harness): an exit while one runs a step (the biLM, a writer) leaves
native code (torch, pyarrow, h5py) without the GIL; the interpreter's teardown then ends that thread as it takes the
GIL back, unwinding C++ frames that cannot unwind: "terminate called without an active exception", SIGABRT, a core
file where the host keeps them. atexit handlers run before that teardown, while such a thread still runs: settle()
waits there for the steps under way (working()) and lets no new one start.
"""
from __future__ import annotations

import atexit
import gc
import threading
from contextlib import contextmanager

SETTLE_S = 30.0          # at most this long: a batch of the original shape on one thread ends in seconds
_STATE = {"active": 0, "exiting": False, "registered": False}
_CHANGED = threading.Condition()


class ProcessExiting(RuntimeError):
    """Raised where a step would start work in a process that is exiting (working)."""


@contextmanager
def working():
    """A step's work under way in this thread (transforms/chain.py Chain): settle() waits for it to end; once the
    process is exiting, ProcessExiting instead of starting."""
    with _CHANGED:
        if _STATE["exiting"]:
            raise ProcessExiting("the worker process is exiting")
        _STATE["active"] += 1
    try:
        yield
    finally:
        with _CHANGED:
            _STATE["active"] -= 1
            _CHANGED.notify_all()


def check() -> None:
    """ProcessExiting once the process is exiting: a step's own loop of work (as EmbedBatches' sentence-by-sentence
    retries) starts no more of it."""
    with _CHANGED:
        if _STATE["exiting"]:
            raise ProcessExiting("the worker process is exiting")


def settle(limit_s: float = SETTLE_S) -> None:
    """No step starts from now on; wait (up to limit_s) for those under way to end. A step a failed bundle left
    suspended (its generator held by the failure's traceback, in a reference cycle) is closed by a collection first."""
    if _STATE["active"]:
        gc.collect()            # only then: a collection walks every object (torch's: about half a second)
    with _CHANGED:
        _STATE["exiting"] = True
        _CHANGED.wait_for(lambda: _STATE["active"] == 0, timeout=limit_s)


def settle_at_exit() -> None:
    """Idempotent: this process's exit settles first (a worker's setup; pipeline/cli.exit_with, which ends the
    command's process by os._exit, without the teardown, takes it back)."""
    with _CHANGED:
        if _STATE["registered"]:
            return
        _STATE["registered"] = True
    atexit.register(settle)
