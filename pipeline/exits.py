"""Exit statuses of `python -m elmo_pipeline.pipeline.run` / `elmo-pipeline run|plan`, and the mapping of a failure to one.

A scheduler acts on the status: fix the command (USAGE), fix the data (DATA), retry later (TEMPFAIL, the
BSD sysexits EX_TEMPFAIL that mail and job systems retry), or look at it (SOFTWARE). The table is in
docs/failure-behaviour.md#exit-statuses. Beam wraps exceptions raised in DoFns (a new exception whose message
ends "[while running 'Step']", the original as its __context__; a multi-process worker's error reaches the
launcher as text only), so classify() looks through the exception chain and, failing that, at the messages.
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass

from elmo_pipeline.fsio import TRANSIENT_HTTP, exception_chain, http_status, redact, transient_http

OK = 0            # done, or already complete (nothing to do)
USAGE = 2         # bad flag or value, conflicting options, an output that needs --overwrite: fix the command
DATA = 65         # EX_DATAERR: the model files or the inputs are bad or missing: fix the data
SOFTWARE = 70     # EX_SOFTWARE: anything else (a bug, a worker lost): look at the log; a rerun resumes
TEMPFAIL = 75     # EX_TEMPFAIL: retry later: lease held by a live run, storage unreachable or failing after
#                   its retries, out of space; a rerun of the same command resumes
INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's 128 + 2
TERMINATED = 143   # SIGTERM (a scheduler's cancel, a pod's stop), the shell's 128 + 15: ended as a Ctrl-C is


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the command's main thread by its handler (pipeline/cli.py: process): it unwinds the run as
    a Ctrl-C does (the lease given back, --metrics-file written, its workers ended), then exit TERMINATED."""


TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNREFUSED,
                    errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                    errno.EPIPE}
# EPIPE here is a storage connection's (a peer gone mid-request): transient. The command's own stdout and stderr never
# raise it: a reader gone is theirs to drop where the write is made (pipeline/streams.py), never a failure of the run
# exception classes by name (botocore, aiohttp, urllib3, requests, pyiceberg: none imported here)
TRANSIENT_TYPES = ("LeaseHeld", "RetryLater", "ConnectionError", "EndpointConnectionError",
                   "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError", "ClientConnectorError",
                   "ServerDisconnectedError", "ClientOSError", "ProxyConnectionError", "TimeoutError",
                   "ClientPayloadError",
                   "CommitFailedException")
DATA_TYPES = ("WeightsError", "OptionsError", "DuplicateIdError", "InputChanged",
              "TableFileChanged")   # formats/iceberg/commit.py: a file the table references changed since it was added
USAGE_TYPES = ("PermissionError", "FileExistsError", "NotADirectoryError", "IsADirectoryError",
               "TableMovedError")   # formats/iceberg/upsert.py: an upsert to run again into a new --output
# a --reuse/--reuse-table source missing, damaged or foreign (transforms/reuse.py ReuseError and its subclasses):
# the command's to fix whether planning or a worker's read finds it
REUSE_TYPES = ("ReuseError", "ForeignSourceError", "KernelPathError")
PLANNING_USAGE_TYPES = ("ValueError", "RuntimeError")   # while planning: a bad value, a missing GPU; once running: a
#                                                       bug or a library's complaint
AFTER_PLAN = "_elmo_pipeline_after_plan"
# messages that say the same when only text came through (multi-process workers, Beam's wrapping)
TRANSIENT_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|\[Errno (28|122|11|16|110|111|104|103|113|101|100)\]|"
    r"is held by a live run|Could not connect to the endpoint|Connection (refused|reset)|"
    r"SlowDown|Service Unavailable|InternalError|Read timeout|Connect timeout|ServiceUnavailable|"
    r"\b(ServerError|TooManyRequestsError): |"      # pyiceberg's REST catalog answering 500 or 429 (table.py load_catalog)
    r"ClientResponseError: (5\d\d|%s)\b" % "|".join(map(str, TRANSIENT_HTTP)))
DATA_TEXT = re.compile(r"WeightsError|OptionsError|sha256 mismatch|differs from its first download|"
                       r"download truncated|download failed after|matches no file|not a valid HDF5 file|"
                       r"changed since the run was planned|\bFileNotFoundError\b|ClientResponseError: 4\d\d\b")
REUSE_TEXT = re.compile(r"\b(%s): " % "|".join(REUSE_TYPES))
MEANINGS = {OK: "done", USAGE: "fix the command", DATA: "fix the data", SOFTWARE: "failed",
            TEMPFAIL: "retry later", INTERRUPTED: "interrupted", TERMINATED: "terminated"}


@dataclass(frozen=True)
class Failure:
    status: int
    message: str          # one line, its URLs' secrets redacted (fsio/redact.py)

    def line(self) -> str:
        """The one line a failure prints: `error: <message> (exit N: <what to do>)`."""
        from elmo_pipeline.pipeline.streams import one_line
        return one_line(f"error: {redact(self.message)} (exit {self.status}: {MEANINGS[self.status]})")


def after_plan(exc: BaseException) -> None:
    """Mark a failure as raised after the command was checked and planned: a ValueError then is no bad flag."""
    try:
        setattr(exc, AFTER_PLAN, True)
    except AttributeError:      # an exception type without a __dict__
        pass


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _one_line(exc: BaseException) -> str:
    raw = str(exc)
    if "Traceback (most recent call last)" in raw:    # a worker's error as text: its last 'XError: ...' line
        found = re.findall(r"^\w*(?:Error|Exception|Exit)\b.*$", raw, re.M)
        raw = found[-1] if found else raw
    text = redact(" ".join(raw.split())) or type(exc).__name__     # redacted before it is cut
    if not isinstance(exc, (ValueError, OSError, RuntimeError, ImportError)) or type(exc).__name__ in DATA_TYPES:
        text = f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text
    return text if len(text) <= 600 else text[:597] + "..."


def _status(exc: BaseException) -> int | None:
    """The status one exception (not its chain) says by its type or errno; None when it says nothing."""
    names = _names(exc)
    if isinstance(exc, Terminated):
        return TERMINATED
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    status = http_status(exc) if "ClientResponseError" in names else None     # an HTTP store's answer
    if names & set(TRANSIENT_TYPES) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS) or \
            transient_http(status):
        return TEMPFAIL
    if names & set(DATA_TYPES) or isinstance(exc, FileNotFoundError) or status is not None:
        return DATA
    return None


def classify(exc: BaseException) -> Failure:
    """The exit status and one-line message of a failure (see the module docstring).

    Order: a signal that ended it (SIGTERM, then Ctrl-C) anywhere in the chain, then a transient cause anywhere in
    the chain (a full disk under Beam's wrapping is still a full disk), then a --reuse source's failure (ReuseError
    in the chain, planning or not: TEMPFAIL when its causes' text says storage failed, else USAGE; a source's file
    gone too), then a data cause, a missing optional package
    (USAGE; for a URL's storage the message names what to install: fsio.fs.check_protocol), then the messages
    (text from other processes), then the outermost type: a ValueError or RuntimeError raised while planning (not marked
    after_plan()), a permission or an output holding another command's run are the command's fault, anything
    else SOFTWARE."""
    excs = exception_chain(exc)
    text = " ".join(str(e) for e in excs)
    for want in (TERMINATED, INTERRUPTED, TEMPFAIL, DATA):
        for e in excs:
            if _status(e) == want:
                return Failure(want, _one_line(e) + _step(excs, e))
        if want == TEMPFAIL:        # a --reuse source's failure: retry later where storage failed, else USAGE
            at = next((i for i, e in enumerate(excs) if _names(e) & set(REUSE_TYPES)), None)
            if at is not None:            # its causes' text only: its own message quotes the source's (untrusted)
                causes = " ".join(str(e) for e in excs[at + 1:])
                return Failure(TEMPFAIL if TRANSIENT_TEXT.search(causes) else USAGE,
                               _one_line(excs[at]) + _step(excs, excs[at]))
    if any(isinstance(e, ImportError) for e in excs):      # an optional package not installed: the setup's fault
        return Failure(USAGE, _one_line(exc))
    if TRANSIENT_TEXT.search(text):
        return Failure(TEMPFAIL, _one_line(exc))
    if REUSE_TEXT.search(text):         # before the data text, as the types are looked at in process
        return Failure(USAGE, _one_line(exc))
    if DATA_TEXT.search(text):
        return Failure(DATA, _one_line(exc))
    if _names(exc) & set(USAGE_TYPES) or (_names(exc) & set(PLANNING_USAGE_TYPES) and not getattr(exc, AFTER_PLAN, False)):
        return Failure(USAGE, _one_line(exc))
    return Failure(SOFTWARE, _one_line(exc))


def _step(excs: list[BaseException], found: BaseException) -> str:
    """" [while running 'Step']" from Beam's wrapper in the chain, when `found` does not say it already."""
    for e in excs:
        m = re.search(r" \[while running '[^']*'\]", str(e))
        if m and m.group(0) not in str(found):
            return m.group(0)
    return ""
