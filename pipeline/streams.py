"""The command's standard streams: what it prints is for whoever reads it, and its result never depends on that.

A scheduler may start a command with stdout or stderr closed (`2>&-`) or piped into a reader that exits early
(`plan | head -1`, `2>&1 | true`). What the command prints is then dropped, and nothing else changes: the run
goes on, writes its output and its --metrics-file, and exits with the status of its work (0 for a run that
finished, 2 for a bad flag, ...; docs/scheduling.md#logs-nobody-reads), every subcommand alike.

guard(), first thing in a command's process (pipeline/cli.py process()):
- a closed descriptor 0, 1 or 2 is opened on os.devnull (otherwise the next file the process opens takes its
  number, and what is written to "stderr", by this process or a child, lands in that file), and sys.stdin,
  sys.stdout or sys.stderr, None then, is opened on it;
- sys.stdout and sys.stderr write through Unread (fsio/streams.py): a write or flush that finds its reader gone (EPIPE) or its
  descriptor closed (EBADF), or on stderr (logs only) any failure of the stream (a full disk: ENOSPC, EIO), points
  the descriptor at os.devnull and drops the text; later writes, the interpreter's last flush and children started
  afterwards go there too. What a command prints as its product (`plan`'s text on stdout) failing otherwise is
  that command's failure (pipeline/exits.py: ENOSPC is 75).
Only these streams' own writes are caught here: an EPIPE of a storage connection stays what it is (a transient
failure: pipeline/exits.py, 75). say() prints a line where the streams may be unguarded (main() called in a
process of someone else's, a test's).
"""
from __future__ import annotations

import os
import re
import sys

from elmo_pipeline.fsio.streams import Unread, reader_gone, to_devnull

def guard() -> None:
    """Idempotent: the process's standard streams as the module docstring says."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            to_devnull(fd)
    if sys.stdin is None:
        sys.stdin = open(0, "r", closefd=False)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(fd, "w", buffering=1, errors="backslashreplace", closefd=False)
        if not isinstance(stream, Unread):
            setattr(sys, name, Unread(stream, logs=name == "stderr"))


def say(text: str, file=None) -> None:
    """print(text) to `file` (default sys.stderr: logs); nothing when that stream is closed or nobody reads it, or
    when the logs' stream fails in any way; stdout's other failures are raised (the command's product)."""
    logs = file is None or file is sys.stderr
    file = sys.stderr if file is None else file
    if file is None:
        return
    try:
        print(text, file=file, flush=True)
    except OSError as e:
        if not (logs or reader_gone(e)):
            raise


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` as one line of plain text: its control characters (a newline, a terminal's escape, ...) written as
    Python writes them in a string's repr (\\n, \\x1b), so a path or name holding them cannot start another line
    (one that reads `error: ...`) nor drive the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def stderr_is_terminal() -> bool:
    """Whether sys.stderr is a terminal (False when it is closed: None)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError, AttributeError):
        return False
