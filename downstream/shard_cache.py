"""Local copies of remote (fsspec URL) shards, so they can be memory-mapped; the next shard is fetched in the
background (read-ahead). No Beam import.

A shard of output `path` (run key K, the manifest's SHA-256 of the file S) is copied whole to
<cache_dir>/<sha256(path|K|S)[:16]>/<file name>, by a unique temporary name and a rename, its bytes checked against S
before the rename: a copy there is complete and is the file the manifest records (a file rewritten since, its record
with it, is copied again). cache_dir defaults to <tmp>/elmo-mapped.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import tempfile
import threading

from elmo_pipeline.downstream.shard_checks import DamagedOutput
from elmo_pipeline.fsio import file_sha256, replacing


def download(fs, path: str, local: str, record: dict | None = None) -> None:
    """Copy fs:path to the local file `local`, whole or not at all (a unique temporary name, then a rename);
    DamagedOutput, nothing kept, when its bytes are not the `record` ({"bytes", "sha256"}) the manifest holds."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with replacing(local) as tmp:
        fs.get_file(path, tmp)
        if record is not None and (os.path.getsize(tmp) != record["bytes"] or file_sha256(tmp) != record["sha256"]):
            raise DamagedOutput(f"{path}: not the file the manifest records ({record['bytes']} bytes, sha256 "
                                f"{record['sha256'][:12]}...): replaced since")


class ShardCache:
    """Local copies of remote shards under cache_dir; background copies in flight are per process (a pickled
    or forked cache starts with none)."""

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
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
        root = self.cache_dir or os.path.join(tempfile.gettempdir(), "elmo-mapped")
        run, record = out.manifest.get("run"), _record(out, path)
        ident = f"{out.path}|{run.get('key') if isinstance(run, dict) else None}|{record['sha256'] if record else ''}"
        return os.path.join(root, hashlib.sha256(ident.encode()).hexdigest()[:16], posixpath.basename(path))

    def local(self, out, path: str) -> str:
        """The local copy of out's shard `path`: waits for its background copy, else copies it now (unless a
        copy of the same size is there: one checked against its record as it was copied)."""
        local = self.local_path(out, path)
        fetching = self._in_flight().pop(local, None)
        if fetching is not None:
            fetching.join()
        if not (os.path.exists(local) and os.path.getsize(local) == out.fs.size(path)):
            download(out.fs, path, local, _record(out, path))
        return local

    def prefetch(self, out, path: str) -> None:
        """Start copying out's shard `path` in the background, unless a copy is there or under way."""
        local, fetching = self.local_path(out, path), self._in_flight()
        if local in fetching or os.path.exists(local):
            return
        t = threading.Thread(target=_quietly, args=(download, out.fs, path, local, _record(out, path)), daemon=True)
        t.start()
        fetching[local] = t


def _record(out, path: str) -> dict | None:
    """The manifest's record ({"bytes", "sha256"}) of out's file `path`; None where it records none."""
    return (out.files or {}).get(posixpath.relpath(path, out.root))


def _quietly(fn, *args) -> None:
    """fn(*args) in a background thread, its failure dropped: local() copies the file again and raises it there."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass
