"""A lease: one live holder of a lock object (a local file or an object-store key) at a time.

The lease object is JSON: {token, owner, host, machine, pid, pidns, start, heartbeat} (times in Unix seconds).
It is created atomically, refreshed by a heartbeat thread while its holder lives, and taken over by another
process only when it is stale (is_stale):
- its heartbeat is older than `stale_seconds`;
- or its holder is a process of this machine (same host name, machine identity: /etc/machine-id and the
  kernel's boot id, and pid namespace) that no longer exists;
- an object that is no lease (not JSON, not an object, a heartbeat that is no finite number) or whose
  heartbeat lies more than `stale_seconds` in the future: once the object itself (its modification time on
  the store) is older than `stale_seconds`. So an edited or damaged lease never jams the output.
The token is a fencing token: check_held() reads it back before each irreversible step of its holder, which
stops (LeaseLost, a RetryLater) once another run took the lease over; the holder's workers check it through a
Fence before each write they stage (cached while the last heartbeat read is younger than the stale age minus
the beat interval). Every change is a compare-and-swap:
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
import math
import os
import socket
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from elmo_pipeline.fsio.fs import atomic_write, is_local_fs, json_or_none, makedirs, protocol, url_fs

logger = logging.getLogger("elmo-pipeline.lease")
LEASE_BYTES = 1 << 20          # a lease object is a few hundred bytes: a larger one is no lease


def _user() -> str:
    """The name of the user this process runs as ('' when the system has none for it): a lease's owner."""
    import pwd
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return ""


GUARD_WAIT_SECONDS = 10.0      # the longest a local lease waits for the folder's flock (held for a read and a write)


class LeaseHeld(RuntimeError):
    """The lease is held by a live process (the message names it)."""


class RetryLater(RuntimeError):
    """A run that cannot finish now but that the same command, rerun, finishes (another run took the output, a
    commit kept conflicting, work is still missing): the scheduler's "retry later" (pipeline/exits.py: 75)."""


class LeaseLost(RetryLater):
    """This run's lease was taken over by another run: it writes nothing more (Fence, Lease.check_held)."""


def _pidns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _machine() -> str:
    """This machine's identity: /etc/machine-id and the boot id of its running kernel ('' where neither exists).
    Unlike the pid-namespace inode (the same number on every Linux host), it differs between machines."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    return ":".join(parts) if any(parts) else ""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:          # EPERM: it exists, owned by someone else
        return True
    return True


def heartbeat_of(holder) -> float | None:
    """The heartbeat (Unix seconds) of a well-formed lease object: a JSON object whose heartbeat is a finite
    number; None for anything else."""
    beat = holder.get("heartbeat") if isinstance(holder, dict) else None
    if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not math.isfinite(beat):
        return None
    return float(beat)


def _token(holder) -> str | None:
    return holder.get("token") if isinstance(holder, dict) else None


def _dated_by_object(holder, stale_seconds: float, now: float) -> bool:
    """True when the lease object's own modification time decides its age: no readable heartbeat, or one more
    than `stale_seconds` in the future."""
    beat = heartbeat_of(holder)
    return beat is None or beat - now > stale_seconds


def describe(holder, now: float | None = None, mtime: float | None = None) -> str:
    """'pid 123 on host h (owner u, started 40 s ago, last heartbeat 2 s ago)'; for an object without a usable
    heartbeat, its age as the store reports it (`mtime`, Unix seconds)."""
    now = time.time() if now is None else now
    beat = heartbeat_of(holder)
    written = f"last written {now - mtime:.0f} s ago" if mtime is not None else "age unknown"
    if beat is None:
        return f"a lease object without a usable heartbeat ({written})"
    start = holder.get("start")
    start = start if isinstance(start, (int, float)) and not isinstance(start, bool) else beat
    when = (f"last heartbeat {now - beat:.0f} s ago" if beat <= now + 1 else
            f"heartbeat dated {beat - now:.0f} s in the future, {written}")
    return (f"pid {holder.get('pid')} on host {holder.get('host')} (owner {holder.get('owner')}, started "
            f"{now - start:.0f} s ago, {when})")


def _same_machine(holder: dict) -> bool:
    machine = _machine()
    return bool(machine) and (holder.get("host"), holder.get("machine"), holder.get("pidns")) == (
        socket.gethostname(), machine, _pidns())


def is_stale(holder, stale_seconds: float, now: float | None = None, mtime: float | None = None) -> bool:
    """True when `holder` (the parsed lease object, any JSON value) can be taken over: its heartbeat is older
    than `stale_seconds`, or it is a process of this machine that no longer exists. An object without a
    usable heartbeat (or one more than `stale_seconds` in the future) is stale once its modification time
    `mtime` (Unix seconds) is older than `stale_seconds`, or when that time is unknown (None)."""
    now = time.time() if now is None else now
    if _dated_by_object(holder, stale_seconds, now):
        return mtime is None or now - mtime > stale_seconds
    if now - heartbeat_of(holder) > stale_seconds:
        return True
    pid = holder.get("pid")
    return (_same_machine(holder) and isinstance(pid, int) and not isinstance(pid, bool) and not _alive(pid))


def _modified(info: dict) -> float | None:
    """An fsspec info dict's modification time in Unix seconds (local mtime, S3 LastModified, ...), or None."""
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return v.timestamp()
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return None


@dataclass
class LeaseObject:
    """The lease object as read: its parsed JSON (any value; NOT_JSON when it does not parse), its ETag (s3) and
    its modification time (Unix seconds, None when the store gives none)."""
    holder: object
    etag: str | None
    mtime: float | None

    @property
    def token(self) -> str | None:
        return _token(self.holder)

    def stale(self, stale_seconds: float) -> bool:
        return is_stale(self.holder, stale_seconds, mtime=self.mtime)

    def describe(self) -> str:
        return describe(self.holder, mtime=self.mtime)


NOT_JSON = "<not JSON>"


def read_lease(fs, path: str, s3: bool) -> LeaseObject | None:
    """The lease object at `path`, None when there is none."""
    try:
        info = fs.info(path, refresh=True) if s3 else fs.info(path)
        if (is_local_fs(fs) and not stat.S_ISREG(os.stat(path).st_mode)) or (info.get("size") or 0) > LEASE_BYTES:
            data = b""              # a FIFO, a device or a huge file: no lease (never read: no hang, no allocation)
        else:
            data = fs.cat_file(path)    # s3: a change since info() fails the If-Match on its ETag
    except FileNotFoundError:
        return None
    holder = json_or_none(data)
    holder = NOT_JSON if holder is None else holder
    return LeaseObject(holder, info.get("ETag") if s3 else None, _modified(info))


def _refuse_live(url: str, found: LeaseObject, stale_seconds: float) -> None:
    """LeaseHeld when the lease object `found` is not stale (its holder may still run)."""
    if not found.stale(stale_seconds):
        raise LeaseHeld(f"{url} is held by a live run: {found.describe()}; it is taken over only when its heartbeat "
                        "(without a usable one: the lease object itself) is older than "
                        f"{stale_seconds:.0f} s (--lease-stale-seconds)")


def check_free(url: str, stale_seconds: float, storage_options: dict | None = None) -> None:
    """LeaseHeld, as Lease.acquire() would raise it now, when the lease at `url` is held by a live run (dated as
    acquire() dates it: a lease object without a usable heartbeat by its own modification time). Reads only
    (--dry-run)."""
    fs, path = url_fs(url, storage_options)
    found = read_lease(fs, path, protocol(url) == "s3")
    if found is not None:
        _refuse_live(url, found, stale_seconds)


@dataclass
class Fence:
    """The workers' check that their run still holds the output's lease, before each write (output/sink.py):
    LeaseLost once the lease object carries another token (or is gone). Cheap: after a read that showed this
    run's token with heartbeat h, it trusts the lease without reading again while now - h < stale_seconds -
    beat_seconds (no other run may take a lease over before its heartbeat is stale_seconds old, and the holder
    beats every beat_seconds). Picklable: it travels to the workers."""
    url: str
    token: str
    stale_seconds: float
    beat_seconds: float
    storage_options: dict | None = None
    seen: float | None = field(default=None, compare=False)    # the heartbeat last read with this token

    def __call__(self) -> None:
        if self.seen is not None and time.time() - self.seen < self.stale_seconds - self.beat_seconds:
            return
        fs, path = url_fs(self.url, self.storage_options)
        found = read_lease(fs, path, protocol(self.url) == "s3")
        if found is None or found.token != self.token:
            raise LeaseLost(f"lost the lease {self.url} to another run (this run was paused or cut off longer "
                            f"than --lease-stale-seconds {self.stale_seconds:.0f}); that run owns the output now, "
                            "and this one wrote nothing more")
        beat = found.holder.get("heartbeat") if isinstance(found.holder, dict) else None
        self.seen = beat if isinstance(beat, (int, float)) and math.isfinite(beat) else None


class Lease:
    """Acquire with acquire() (LeaseHeld when live elsewhere), give back with release(); `lost` is set when
    the heartbeat finds the lease taken over or gone; check_held() before each irreversible step raises
    RetryLater once it is lost. Also a context manager."""

    def __init__(self, url: str, stale_seconds: float = 60.0, storage_options: dict | None = None,
                 heartbeat_seconds: float | None = None):
        self.url, self.stale, self.storage_options = url, float(stale_seconds), storage_options
        self.every = heartbeat_seconds or max(0.2, self.stale / 4)
        self.fs, self.path = url_fs(url, storage_options)
        self.local, self.s3 = is_local_fs(self.fs), protocol(url) == "s3"
        now = time.time()
        self.me = {"token": uuid.uuid4().hex, "owner": _user(), "host": socket.gethostname(),
                   "machine": _machine(), "pid": os.getpid(), "pidns": _pidns(), "start": now, "heartbeat": now}
        self.etag: str | None = None
        self.taken_over = None       # the parsed stale lease object this one replaced, if any
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()    # the heartbeat thread and check_held() write in turn

    # -- the store ------------------------------------------------------------------------------------
    @contextmanager
    def _guard(self):
        """Serialises read-check-write: between this process's threads, and on a local lease between processes
        with an flock on the folder holding it (never a file of its own, which a release would have to remove
        while another process may be waiting on it)."""
        with self._mutex:
            if not self.local:
                yield
                return
            import fcntl
            folder = os.path.dirname(self.path)
            makedirs(self.fs, folder)
            fd = os.open(folder, os.O_RDONLY)
            try:
                deadline = time.monotonic() + GUARD_WAIT_SECONDS
                while True:             # never blocks for good: a process holding the flock may be stopped
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise LeaseHeld(f"{folder} is locked (flock) by another process for over "
                                            f"{GUARD_WAIT_SECONDS:.0f} s (a paused run, or a tool such as `flock "
                                            f"{folder} ...` wrapping this command: lock another path)") from None
                        time.sleep(0.05)
                yield
            finally:
                os.close(fd)

    def _read(self) -> LeaseObject | None:
        """The lease object, None when there is none."""
        return read_lease(self.fs, self.path, self.s3)

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
        replaced = ""
        with self._guard():
            found = self._read()
            if found is not None and found.token != self.me["token"]:
                _refuse_live(self.url, found, self.stale)
                self.taken_over, replaced = found.holder, found.describe()
            try:
                self._write(self._body(), create=found is None, etag=found and found.etag)
            except FileExistsError:     # s3: created by another process since we looked (or by our own retry)
                now_found = self._read()
                if now_found is None or now_found.token != self.me["token"]:
                    raise LeaseHeld(f"{self.url} was taken by another run a moment ago: "
                                    f"{now_found.describe() if now_found else 'since released'}") from None
            except OSError as e:        # s3: If-Match failed, another process took the stale lease first
                if not self.s3:
                    raise
                raise LeaseHeld(f"{self.url} was taken over by another run a moment ago ({e})") from None
        if self.taken_over is not None:
            logger.warning("took over a stale lease: %s", replaced)
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
            self._renew()

    def _renew(self) -> None:
        found = self._read()
        if found is None or found.token != self.me["token"]:
            self.lost.set()
            logger.error("lost the lease %s to %s", self.url, found.describe() if found else "nobody (removed)")
            return
        self.me["heartbeat"] = time.time()
        try:
            self._write(self._body(), create=False, etag=found.etag)
        except OSError:
            if self.s3:       # If-Match failed: taken over between our read and write
                self.lost.set()
                return
            raise

    def check_held(self) -> None:
        """RetryLater unless the lease object still carries this holder's token (a fencing token), read from the
        store now; a heartbeat that is due is written first, under the same guard, so that nobody can judge the
        lease stale between this check and the step it allows (unless this process is paused past the stale
        age right after it). Called before each irreversible step (output/finalize.py)."""
        if not self.lost.is_set():
            with self._guard():
                if time.time() - self.me["heartbeat"] >= self.every:
                    self._renew()
                else:
                    found = self._read()
                    if found is None or found.token != self.me["token"]:
                        self.lost.set()
        if self.lost.is_set():
            raise LeaseLost(f"lost the lease {self.url} to another run (this run was paused or cut off longer "
                             f"than --lease-stale-seconds {self.stale:.0f}); that run owns the output now, and "
                             "this one changed nothing more")

    def fence(self) -> Fence:
        """The workers' fence of this lease (Fence: checked before each staged write)."""
        return Fence(self.url, self.me["token"], self.stale, self.every, self.storage_options)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease object if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            with self._guard():
                found = self._read()
                if found is not None and found.token == self.me["token"]:
                    self.fs.rm_file(self.path)
        except LeaseHeld as e:      # left in place: stale after --lease-stale-seconds, then taken over
            logger.warning("lease not removed: %s", e)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
