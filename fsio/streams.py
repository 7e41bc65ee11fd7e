"""A standard stream whose writes never fail the work: Unread drops what it is given once nobody reads it (the
reader exited: EPIPE; the descriptor closed: EBADF) or, for logs, once the stream fails in any way (a full disk).
pipeline/streams.py guards a command's own streams with it; a worker process that inherited a pipe whose reader is
gone writes its progress bar through it (transforms/progress.py)."""
from __future__ import annotations

import errno
import os


GONE = (errno.EPIPE, errno.EBADF)   # the reader of a stream exited, or its descriptor was closed


def reader_gone(e: BaseException) -> bool:
    """Whether `e`, raised by a write to a standard stream, says nobody reads it any more."""
    return isinstance(e, OSError) and e.errno in GONE


def to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


class Unread:
    """A standard stream whose writes and flushes are dropped once nobody reads it, or for `logs` (stderr) once it
    fails in any way (see the module docstring)."""

    def __init__(self, stream, logs: bool = False):
        self.stream, self.logs = stream, logs

    def _dropped(self, e: OSError) -> bool:
        return self.logs or reader_gone(e)

    def _gone(self) -> None:
        try:
            to_devnull(self.stream.fileno())
            self.stream.flush()         # what it still buffered, into os.devnull
        except (OSError, ValueError):
            pass

    def write(self, text) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            if not self._dropped(e):
                raise
            self._gone()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            if not self._dropped(e):
                raise
            self._gone()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
