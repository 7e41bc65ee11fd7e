"""Reading model files from local paths or any fsspec URL (s3://, gs://, https://, ...).

Remote files are fetched once into a local cache (h5py needs a seekable local file).
Cache folder: $ELMO_PIPELINE_CACHE, else ~/.cache/elmo-pipeline.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import fsspec

from fsio.fs import is_local_url as is_local
from fsio.fs import options_for, protocol


def cache_dir() -> str:
    return os.environ.get("ELMO_PIPELINE_CACHE", str(Path.home() / ".cache" / "elmo-pipeline"))


def open_url(url: str, mode: str = "rb", storage_options: dict | None = None, **kwargs):
    """fsspec.open for a path or URL (kwargs: encoding, newline, ...); remote reads go through the local
    file cache. storage_options: {protocol: {...}}."""
    url = str(url)
    if is_local(url) or "w" in mode:
        return fsspec.open(url, mode, **kwargs, **options_for(url, storage_options))
    return fsspec.open(f"filecache::{url}", mode, filecache={"cache_storage": cache_dir()}, **kwargs,
                       **{protocol(url): options_for(url, storage_options)})


def local_path(url: str, sha256: str | None = None, storage_options: dict | None = None) -> str:
    """A local file path holding `url`'s bytes (downloaded into the cache if remote).

    If `sha256` is given the file is verified and a mismatch raises ValueError.
    """
    url = str(url)
    if is_local(url):
        path = url[len("file://"):] if url.startswith("file://") else url
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {path}")
    else:
        path = fsspec.open_local(f"filecache::{url}", filecache={"cache_storage": cache_dir()},
                                 **{protocol(url): options_for(url, storage_options)})
    if sha256 is not None:
        found = file_sha256(path)
        if found != sha256.lower():
            raise ValueError(f"{url}: sha256 mismatch (expected {sha256}, found {found})")
    return path


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
