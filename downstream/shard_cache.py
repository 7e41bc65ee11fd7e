"""Local copies of remote (fsspec URL) shards, so they can be memory-mapped; the next shard is fetched in the
background (read-ahead). No Beam import.

A shard of output `path` (run key K, the manifest's SHA-256 of the file S) is copied whole to
<cache_dir>/<sha256(path|K|S)[:16]>/<file name>, by a unique temporary name and a rename, its bytes checked against S
before the rename (a file rewritten since, its record with it, is copied again). A copy found there (another process's,
or planted) is used only once checked against the manifest's record, size and SHA-256 (once per process per copy); one
that does not match is refused, never overwritten (a file this reader did not write). cache_dir defaults to
<tmp>/elmo-mapped-<uid>, a folder only this user may write (0o700; anything else there is refused).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tempfile
import threading

from elmo_pipeline.downstream.shard_checks import DamagedOutput
from elmo_pipeline.fsio import replacing, same_digest, url_fs

_CHECKED: set[tuple] = set()       # (path, st_ino, st_size, st_mtime_ns) of copies checked against their record


def download(fs, path: str, local: str, record: dict | None = None) -> None:
    """Copy fs:path to the local file `local`, whole or not at all (a unique temporary name, then a rename);
    DamagedOutput, nothing kept, when its bytes are not the `record` ({"bytes", "sha256"}) the manifest holds."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with replacing(local) as tmp:
        if record is None:
            fs.get_file(path, tmp)
        else:               # copied and checked in one pass, at most its size + 1 read (a huge object never fills
            with open(tmp, "wb") as f:      # the disk)
                same = same_digest(fs, path, record, copy_to=f)
            if not same:
                raise DamagedOutput(f"{path}: not the file the manifest records ({record['bytes']} bytes, sha256 "
                                    f"{record['sha256'][:12]}...): replaced since")
        st = os.stat(tmp)
    if record is not None:                  # checked as copied: renamed, the same inode and times
        _CHECKED.add(_identity(local, st))


def _identity(local: str, st: os.stat_result) -> tuple:
    return local, st.st_ino, st.st_size, st.st_mtime_ns


def checked_copy(local: str, path: str, record: dict | None, size) -> bool:
    """Whether the local file `local` is there to use as the copy of `path`: a regular file (not a link) of the
    manifest's `record`, size and SHA-256 (checked once per process while its inode, size and mtime stay);
    DamagedOutput naming it when it is not (it is left there: this reader did not write it). record None (an output
    of a version that recorded none): a regular file of the remote's size(), unchecked."""
    try:
        st = os.lstat(local)
    except FileNotFoundError:
        return False
    if record is None:
        return stat.S_ISREG(st.st_mode) and st.st_size == size()
    key = _identity(local, st)
    if key in _CHECKED:
        return True
    if not stat.S_ISREG(st.st_mode) or st.st_size != record["bytes"] \
            or not same_digest(url_fs(local)[0], local, record):
        raise DamagedOutput(f"{local}: in the shard cache but not {path} as its manifest records it ({record['bytes']} "
                            f"bytes, sha256 {record['sha256'][:12]}...); not written by this reader: remove it")
    _CHECKED.add(key)
    return True


def private_root(root: str) -> str:
    """root, a folder only this user can write, made 0o700 when missing; PermissionError unless it is a folder
    (not a link) of this user's without group or other write (a copy someone else planted would be read)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{root}: the shard cache folder is not a folder of this user's (uid {os.getuid()}) "
                              "that only it can write; remove it or pass cache_dir")
    return root


class ShardCache:
    """Local copies of remote shards under cache_dir; background copies in flight are per process (a pickled
    or forked cache starts with none)."""

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
        self._root: str | None = None           # cache_dir, or the default checked once (private_root)
        self._fetching: dict[str, threading.Thread] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fetching": {}}

    def _in_flight(self) -> dict[str, threading.Thread]:
        if self._pid != os.getpid():
            self._fetching, self._pid = {}, os.getpid()
        return self._fetching

    def local_path(self, out, path: str) -> str:
        """Where the copy of `path`, a shard of the ElmoOutput `out`, goes."""
        if self._root is None:
            self._root = self.cache_dir or private_root(os.path.join(tempfile.gettempdir(),
                                                                     f"elmo-mapped-{os.getuid()}"))
        root = self._root
        run, record = out.manifest.get("run"), _record(out, path)
        ident = f"{out.path}|{run.get('key') if isinstance(run, dict) else None}|{record['sha256'] if record else ''}"
        return os.path.join(root, hashlib.sha256(ident.encode()).hexdigest()[:16], posixpath.basename(path))

    def local(self, out, path: str) -> str:
        """The local copy of out's shard `path`: waits for its background copy, else copies it now (unless a
        copy is there: used once checked against its record, checked_copy)."""
        local = self.local_path(out, path)
        fetching = self._in_flight().pop(local, None)
        if fetching is not None:
            fetching.join()
        _ensure(out.fs, path, local, _record(out, path))
        return local

    def prefetch(self, out, path: str) -> None:
        """Start copying out's shard `path` in the background (or checking a copy found there), unless a copy
        checked in this process is there or one is under way."""
        local, fetching, record = self.local_path(out, path), self._in_flight(), _record(out, path)
        if local in fetching or record is None and os.path.exists(local) or _checked(local):
            return
        t = threading.Thread(target=_quietly, args=(_ensure, out.fs, path, local, record), daemon=True)
        t.start()
        fetching[local] = t


def _ensure(fs, path: str, local: str, record: dict | None) -> None:
    """A copy of fs:path at `local`: the one there once checked (checked_copy), else downloaded."""
    if not checked_copy(local, path, record, lambda: fs.size(path)):
        download(fs, path, local, record)


def _checked(local: str) -> bool:
    """Whether `local` is a copy checked in this process, unchanged since."""
    try:
        return _identity(local, os.lstat(local)) in _CHECKED
    except FileNotFoundError:
        return False


def _record(out, path: str) -> dict | None:
    """The manifest's record ({"bytes", "sha256"}) of out's file `path`; None where it records none."""
    return (out.files or {}).get(posixpath.relpath(path, out.root))


def _quietly(fn, *args) -> None:
    """fn(*args) in a background thread, its failure dropped: local() copies the file again and raises it there."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass
