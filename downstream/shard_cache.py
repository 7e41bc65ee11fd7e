"""Local copies of remote (fsspec URL) shards, so they can be memory-mapped; the next shard is fetched in the
background (read-ahead). No Beam import.

A shard of output `path` (run key K) is copied whole to <cache_dir>/<sha256(path|K)[:16]>/<file name>, by
a unique temporary name and a rename: a copy there is complete. cache_dir defaults to
<tmp>/elmo-mapped.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import tempfile
import threading

from elmo_pipeline.fsio import replacing


def download(fs, path: str, local: str) -> None:
    """Copy fs:path to the local file `local`, whole or not at all (a unique temporary name, then a rename)."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with replacing(local) as tmp:
        fs.get_file(path, tmp)


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
        key = hashlib.sha256(f"{out.path}|{out.manifest.get('run', {}).get('key')}".encode()).hexdigest()[:16]
        return os.path.join(root, key, posixpath.basename(path))

    def local(self, out, path: str) -> str:
        """The local copy of out's shard `path`: waits for its background copy, else copies it now (unless a
        copy of the same size is there)."""
        local = self.local_path(out, path)
        fetching = self._in_flight().pop(local, None)
        if fetching is not None:
            fetching.join()
        if not (os.path.exists(local) and os.path.getsize(local) == out.fs.size(path)):
            download(out.fs, path, local)
        return local

    def prefetch(self, out, path: str) -> None:
        """Start copying out's shard `path` in the background, unless a copy is there or under way."""
        local, fetching = self.local_path(out, path), self._in_flight()
        if local in fetching or os.path.exists(local):
            return
        t = threading.Thread(target=download, args=(out.fs, path, local), daemon=True)
        t.start()
        fetching[local] = t
