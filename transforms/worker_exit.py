"""A worker process's exit waits for its threads' work in the product's code (a bounded wait). No Beam import.

A runner's worker threads are daemons (Beam's SDK harness): an exit while one runs the biLM or a writer leaves
native code (torch, pyarrow, h5py) without the GIL; the interpreter's teardown then ends that thread as it takes
the GIL back, unwinding C++ frames that cannot unwind: "terminate called without an active exception", SIGABRT,
a core file where the host keeps them. atexit handlers run before that teardown, while such a thread still runs.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # elmo_pipeline/ (a checkout's root)
SETTLE_S = 30.0          # at most this long: a batch of the original shape on one thread ends in seconds
_REGISTERED = threading.Lock()


@functools.lru_cache(maxsize=None)
def _product_folder(name: str) -> bool:
    """Whether PACKAGE/name is one of the product's packages (a checkout's .venv beside them is not)."""
    return os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))


def _ours(filename: str) -> bool:
    rel = os.path.relpath(filename, PACKAGE) if filename.startswith(PACKAGE + os.sep) else None
    return rel is not None and _product_folder(rel.split(os.sep)[0])


def _busy_in_product() -> list[int]:
    """Ident of each other daemon thread with a frame of the product's code on its stack."""
    me, busy = threading.get_ident(), []
    daemons = {t.ident for t in threading.enumerate() if t.daemon}
    for ident, frame in sys._current_frames().items():
        while ident != me and ident in daemons and frame is not None:
            if _ours(frame.f_code.co_filename):
                busy.append(ident)
                break
            frame = frame.f_back
    return busy


EXITING = threading.Event()


class ProcessExiting(RuntimeError):
    """Raised where a step would start work in a process that is exiting (check)."""


def check() -> None:
    """ProcessExiting once settle() has begun: a step's thread takes no new work into native code."""
    if EXITING.is_set():
        raise ProcessExiting("the worker process is exiting")


def settle(limit_s: float = SETTLE_S) -> None:
    """Wait (up to limit_s) until no daemon thread runs the product's code; from its start, steps take no new work
    (check)."""
    EXITING.set()
    end = time.monotonic() + limit_s
    while _busy_in_product() and time.monotonic() < end:
        time.sleep(0.02)


def settle_at_exit() -> None:
    """Idempotent: this process's exit settles first (a worker's setup; pipeline/cli.exit_with, which ends the
    command's process by os._exit, without the teardown, takes it back)."""
    if _REGISTERED.acquire(blocking=False):
        atexit.register(settle)
