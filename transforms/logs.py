"""The log lines of a process that runs the pipeline's steps, a worker's as the launcher's: secrets redacted
(fsio.redact_logs) and Beam's error records of a failing bundle dropped (their tracebacks; the launcher reports the
failure in one line, pipeline/exits.py, with the whole chain under --verbose). No Beam import.

A multi-process or cluster worker configures its own logging, which the launcher's filters never reach: each step
sets this up when a worker sets the step up (transforms/chain.py Chain, transforms/write_step.py SkipCommitted).
"""
from __future__ import annotations

import logging
import sys

from elmo_pipeline.fsio import redact, redact_logs


class _DropBeamTracebacks(logging.Filter):
    """Beam logs a failing DoFn's exception with its traceback (and again as the bundle fails)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith("apache_beam"))


BEAM_FAILURES = _DropBeamTracebacks()


def quiet_failures() -> None:
    """Idempotent: Beam's error records (tracebacks of the failure the command reports in one line) dropped."""
    for name in ("apache_beam", ""):
        logging.getLogger(name).addFilter(BEAM_FAILURES)
    for handler in logging.getLogger().handlers:
        handler.addFilter(BEAM_FAILURES)


class _RedactingStream:
    """A text stream that writes what it is given redacted (fsio.redact) to the stream it wraps, less the failing
    bundle's traceback Beam's SDK worker prints (the record it logs beside is dropped too, quiet_failures; the
    launcher reports the failure in one line, the whole chain under --verbose)."""

    def __init__(self, stream):
        self.stream = stream
        self._drop_end = False            # print()'s line end after a dropped traceback, written next

    def write(self, text: str) -> int:
        if self._drop_end and text == "\n":
            self._drop_end = False
            return 1
        self._drop_end = False
        if isinstance(text, str) and text.startswith("Traceback (most recent call last):") and _printed_by_beam():
            self._drop_end = True
            return len(text)
        self.stream.write(redact(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _printed_by_beam() -> bool:
    """Whether the write being made comes from Beam's SDK worker printing a failed instruction's traceback
    (SdkHarness._execute: print(traceback_string, file=sys.stderr), print being no Python frame)."""
    caller = sys._getframe(2).f_code
    return caller.co_name == "_execute" and caller.co_filename.replace("\\", "/").endswith(
        "apache_beam/runners/worker/sdk_worker.py")


def worker_logs() -> None:
    """Idempotent: this process's log lines redacted and without Beam's failure tracebacks, and what it prints on
    stderr redacted, less the failing bundle's traceback Beam's SDK worker prints there (_RedactingStream) (a
    worker's setup)."""
    redact_logs()
    quiet_failures()
    if sys.stderr is not None and not isinstance(sys.stderr, _RedactingStream):     # None: stderr closed
        sys.stderr = _RedactingStream(sys.stderr)
