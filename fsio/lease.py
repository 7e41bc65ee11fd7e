"""A lease: one live holder of a lock object (a local file or an object-store key) at a time.

The lease object is JSON: {token, owner, host, pid, pidns, start, heartbeat} (times in Unix seconds). It is
created atomically, refreshed by a heartbeat thread while its holder lives, and taken over by another
process only when it is stale: its heartbeat is older than `stale_seconds`, or its holder is a process of
this host (same pid namespace) that no longer exists. Every change is a compare-and-swap:
- local files: read-check-write under an flock on the folder holding the lease (held for microseconds;
  the kernel drops it when a process dies);
- s3://: conditional PUTs, If-None-Match: * to create and If-Match: <ETag> to refresh or take over
  (AWS S3 and moto honour both);
- other stores: read-check-write without a condition: two processes taking over the same stale lease in
  the same instant may both believe they hold it (the heartbeat then notices the loss of one of them).
Heartbeat ages compare the holder's clock with the reader's: hosts sharing a lease need synchronised
clocks (NTP) and a stale age well above their skew.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager

from fsio.fs import atomic_write, is_local_fs, makedirs, protocol, url_fs

logger = logging.getLogger("elmo-pipeline.lease")


class LeaseHeld(RuntimeError):
    """The lease is held by a live process (the message names it)."""


class RetryLater(RuntimeError):
    """A run that cannot finish now but that the same command, rerun, finishes (another run took the output, a
    commit kept conflicting, work is still missing): the scheduler's "retry later" (pipeline/exits.py: 75)."""


def _pidns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # EPERM: it exists, owned by someone else
        return True
    return True


def describe(holder: dict, now: float | None = None) -> str:
    """'pid 123 on host h (owner u, started 40 s ago, last heartbeat 2 s ago)'."""
    now = time.time() if now is None else now
    started, beat = now - holder.get("start", now), now - holder.get("heartbeat", now)
    return (f"pid {holder.get('pid')} on host {holder.get('host')} (owner {holder.get('owner')}, started "
            f"{started:.0f} s ago, last heartbeat {beat:.0f} s ago)")


def is_stale(holder: dict, stale_seconds: float, now: float | None = None) -> bool:
    """True when `holder` can be taken over: an old heartbeat, or a dead process of this host."""
    now = time.time() if now is None else now
    if now - float(holder.get("heartbeat", 0)) > stale_seconds:
        return True
    return (holder.get("host") == socket.gethostname() and holder.get("pidns") == _pidns()
            and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]))


class Lease:
    """Acquire with acquire() (LeaseHeld when live elsewhere), give back with release(); `lost` is set when
    the heartbeat finds the lease taken over or gone. Also a context manager."""

    def __init__(self, url: str, stale_seconds: float = 60.0, storage_options: dict | None = None,
                 heartbeat_seconds: float | None = None):
        self.url, self.stale = url, float(stale_seconds)
        self.every = heartbeat_seconds or max(0.2, self.stale / 4)
        self.fs, self.path = url_fs(url, storage_options)
        self.local, self.s3 = is_local_fs(self.fs), protocol(url) == "s3"
        now = time.time()
        self.me = {"token": uuid.uuid4().hex, "owner": os.environ.get("USER", ""), "host": socket.gethostname(),
                   "pid": os.getpid(), "pidns": _pidns(), "start": now, "heartbeat": now}
        self.etag: str | None = None
        self.taken_over: dict | None = None      # the stale holder this lease replaced, if any
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the store ------------------------------------------------------------------------------------
    @contextmanager
    def _guard(self):
        """Serialises read-check-write on a local lease: an flock on the folder holding it (never a file of
        its own, which a release would have to remove while another process may be waiting on it)."""
        if not self.local:
            yield
            return
        import fcntl
        makedirs(self.fs, os.path.dirname(self.path))
        fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> tuple[dict | None, str | None]:
        """(holder, ETag) of the lease object, (None, None) when there is none. An unreadable object is a
        holder with no heartbeat (stale)."""
        try:
            if self.s3:
                etag = self.fs.info(self.path, refresh=True).get("ETag")   # a change in between fails the If-Match
                data = self.fs.cat_file(self.path)
            else:
                data, etag = self.fs.cat_file(self.path), None
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(data), etag
        except ValueError:
            return {"host": "?", "pid": None, "heartbeat": 0}, etag

    def _write(self, data: bytes, create: bool, etag: str | None) -> None:
        """Create (create=True) or replace the lease object; FileExistsError / OSError when the condition fails."""
        if self.s3:
            cond = {"mode": "create"} if create else ({"IfMatch": etag} if etag else {})
            out = self.fs.pipe_file(self.path, data, **cond)
            self.etag = (out or {}).get("ETag")
        elif self.local:
            makedirs(self.fs, os.path.dirname(self.path))
            atomic_write(self.fs, self.path, data)
        else:
            self.fs.pipe_file(self.path, data)

    def _body(self) -> bytes:
        return json.dumps(self.me).encode()

    # -- the protocol ---------------------------------------------------------------------------------
    def acquire(self) -> "Lease":
        with self._guard():
            holder, etag = self._read()
            if holder is not None and holder.get("token") != self.me["token"]:
                if not is_stale(holder, self.stale):
                    raise LeaseHeld(f"{self.url} is held by a live run: {describe(holder)}; it is taken over only "
                                    f"when its heartbeat is older than {self.stale:.0f} s (--lease-stale-seconds)")
                self.taken_over = holder
            try:
                self._write(self._body(), create=holder is None, etag=etag)
            except FileExistsError:     # s3: created by another process since we looked (or by our own retry)
                now_holder, _ = self._read()
                if not now_holder or now_holder.get("token") != self.me["token"]:
                    raise LeaseHeld(f"{self.url} was taken by another run a moment ago: "
                                    f"{describe(now_holder or {})}") from None
            except OSError as e:        # s3: If-Match failed, another process took the stale lease first
                if not self.s3:
                    raise
                raise LeaseHeld(f"{self.url} was taken over by another run a moment ago ({e})") from None
        if self.taken_over:
            logger.warning("took over a stale lease: %s", describe(self.taken_over))
        self._thread = threading.Thread(target=self._beat, name="elmo-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a store error: try again at the next beat
                logger.warning("lease heartbeat failed (will retry): %s: %s", type(e).__name__, e)
            if self.lost.is_set():
                return

    def refresh(self) -> None:
        """Write a new heartbeat if the lease is still ours; set `lost` otherwise."""
        with self._guard():
            holder, etag = self._read()
            if not holder or holder.get("token") != self.me["token"]:
                self.lost.set()
                logger.error("lost the lease %s to %s", self.url, describe(holder) if holder else "nobody (removed)")
                return
            self.me["heartbeat"] = time.time()
            try:
                self._write(self._body(), create=False, etag=etag)
            except OSError:
                if self.s3:       # If-Match failed: taken over between our read and write
                    self.lost.set()
                    return
                raise

    def release(self) -> None:
        """Stop the heartbeat and remove the lease object if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._guard():
            holder, _ = self._read()
            if holder and holder.get("token") == self.me["token"]:
                self.fs.rm_file(self.path)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
