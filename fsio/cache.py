"""Reading model files from local paths or any fsspec URL (s3://, gs://, https://, ...).

Remote files are fetched once into a local cache (h5py needs a seekable local file).
Cache folder: $ELMO_PIPELINE_CACHE, else ~/.cache/elmo-pipeline.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from functools import lru_cache
from pathlib import Path

import fsspec

from elmo_pipeline.fsio.fs import (check_protocol, digest_of, json_or_none, options_for, protocol,
                                  remove_temp_files, replacing, store_failing, url_fs)
from elmo_pipeline.fsio.fs import is_local_url as is_local
from elmo_pipeline.fsio.redact import redact


def cache_dir() -> str:
    return os.environ.get("ELMO_PIPELINE_CACHE", str(Path.home() / ".cache" / "elmo-pipeline"))


def open_url(url: str, mode: str = "rb", storage_options: dict | None = None, cached: bool = True, **kwargs):
    """fsspec.open for a path or URL (kwargs: encoding, newline, ...); remote reads go through the local
    file cache (cached=False: read from the store as they come, for a read of a bounded prefix: the cache fetches
    the whole file first). storage_options: {protocol: {...}}. A local path read must be a regular file
    (regular_file())."""
    url = str(url)
    check_protocol(url)
    if "r" in mode and local_target(url) is not None:
        regular_file(local_target(url))
    if is_local(url) or "w" in mode or not cached:
        return fsspec.open(url, mode, **kwargs, **options_for(url, storage_options))
    if redact(url) != url:      # fsspec's file cache would write the URL, its secret too, into its metadata file
        return fsspec.open(_private_copy(url, storage_options), mode, **kwargs)
    return fsspec.open(f"filecache::{url}", mode, filecache={"cache_storage": cache_dir()}, **kwargs,
                       **{protocol(url): options_for(url, storage_options)})


def _private_copy(url: str, storage_options: dict | None) -> str:
    """A local copy of the remote `url`, which carries a secret (a password, a query's signature, a fragment):
    fetched whole once (replacing(held=True), renamed when whole; a killed fetch's part removed by the next) into
    <cache>/files/<sha256 of the URL>/file, and nothing else recorded: no file holds the URL."""
    folder = os.path.join(cache_dir(), "files", hashlib.sha256(url.encode("utf-8")).hexdigest())
    path = os.path.join(folder, "file")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    remove_temp_files(fsspec.filesystem("file"), folder, ("file",), unless_held=True)
    with replacing(path, held=True) as part:
        try:
            _stream_to(url, part, False, storage_options)
        except OSError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise FileNotFoundError(url) from e.__cause__
            raise
    return path


def local_target(url: str) -> str | None:
    """The local path fsspec reads for `url`, however it is spelled (a path; file://, file:, local://, local:; the
    last URL of a chained one, as `blockcache::/path`), or None when it reads no local file."""
    from fsspec.core import split_protocol
    from fsspec.implementations.local import LocalFileSystem
    last = url.split("::")[-1]
    return LocalFileSystem._strip_protocol(last) if split_protocol(last)[0] in (None, "file", "local") else None


def regular_file(path: str) -> None:
    """FileNotFoundError when the local `path` exists and is no regular file: a FIFO's open blocks until a writer
    comes, a device's read may never end (/dev/zero), so neither is ever opened (a missing path: open() tells)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"{path}: not a regular file (a FIFO, a device or a folder)")


def local_path(url: str, sha256: str | None = None, storage_options: dict | None = None) -> str:
    """A local file path holding `url`'s bytes (downloaded into the cache if remote); a local path must be a
    regular file (FileNotFoundError otherwise).

    If `sha256` is given the file is verified and a mismatch raises ValueError.
    """
    url = str(url)
    if is_local(url):
        path = url[len("file://"):] if url.startswith("file://") else url
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {path}")
        regular_file(path)
    else:       # fsspec.open: one file, never a glob (a presigned URL's ?X-Amz-Signature=... is no wildcard)
        try:
            with open_url(url, storage_options=storage_options) as f:
                path = f.name
        except FileNotFoundError:
            _raise_if_failing(url, storage_options)
            raise FileNotFoundError(f"no such file: {url}") from None     # fsspec's own text speaks of globs
    if sha256 is not None:
        found = file_sha256(path)
        if found != sha256.lower():
            raise ValueError(f"{url}: sha256 mismatch (expected {sha256}, found {found})")
    return path


def _raise_if_failing(url: str, storage_options: dict | None) -> None:
    """fsspec's file cache takes any failure of the store (unreachable, a 5xx) for 'no such file': ask the store
    itself, and raise its own error when it fails rather than lacks the file (fsio.fs.store_failing)."""
    fs, path = url_fs(url, storage_options)
    try:
        fs.info(path)
    except FileNotFoundError as e:
        if store_failing(e):        # unreachable, refused, a 5xx: fsspec's text says "not found"
            raise
    # anything else the store raises is the cause, raised as it is


def file_sha256(path: str) -> str:
    """The SHA-256 of the local file `path` (fsio.fs.digest_of)."""
    return digest_of(fsspec.filesystem("file"), path)["sha256"]


RECORD_SUFFIX = ".sha256.json"   # beside a pinned download: {"url", "sha256", "size"} of its first download


def pinned_download(url: str, path: str, progress: bool | None = None, storage_options: dict | None = None,
                    max_bytes: int | None = None) -> str:
    """`url`'s bytes at local `path`, downloaded once (fsspec, streamed to a temporary name, then renamed; a killed
    download's temporary file is removed by the next one, fsio.held_temp).

    The first download records its sha256 and size in `path` + RECORD_SUFFIX; every later use checks the
    file against that record, and a new download (the file was deleted) must match it too: a changed or
    truncated file raises ValueError naming the file and what differs. A download shorter than the size
    the server announced, or (max_bytes) one larger than max_bytes, raises OSError and leaves nothing under `path`.
    progress: a tqdm bar on stderr (None: only on a terminal)."""
    record_path = path + RECORD_SUFFIX
    record = pinned_record(path)
    if os.path.exists(path):
        if record is None:     # a file without its record: not ours to trust (a crash between rename and record)
            os.remove(path)
        else:
            st = os.stat(path)
            _check_pinned(path, st.st_size, st.st_mtime_ns, record["size"], record["sha256"])
            return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    remove_temp_files(fsspec.filesystem("file"), os.path.dirname(os.path.abspath(path)), (os.path.basename(path),),
                      unless_held=True)       # a killed download's part (up to the weights' size), never a live one's
    with replacing(path, held=True) as part:
        digest, size = _stream_to(url, part, progress, storage_options, max_bytes)
        if record is not None and (size, digest) != (record["size"], record["sha256"]):
            raise ValueError(f"{url}: the download differs from the one first recorded in {record_path} "
                             f"(recorded {record['size']} bytes, sha256 {record['sha256']}; got {size} bytes, "
                             f"sha256 {digest}); the remote file changed: delete the record to accept it")
    if record is None:
        with replacing(record_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"url": redact(url), "sha256": digest, "size": size}, f)
    return path


def pinned_record(path: str) -> dict | None:
    """The {"url", "sha256", "size"} recorded by pinned_download for `path`, or None when there is none;
    ValueError naming the record file when it is damaged (it pins the first download: never replaced silently)."""
    record_path = path + RECORD_SUFFIX
    try:
        data = b""                  # no regular file (a FIFO's open would block): never opened, a damaged record
        if stat.S_ISREG(os.stat(record_path).st_mode):
            with open(record_path, "rb") as f:
                data = f.read(1 << 16)                 # a record is about 200 bytes
    except FileNotFoundError:
        return None
    record = json_or_none(data)
    if not (isinstance(record, dict) and type(record.get("size")) is int and record["size"] >= 0
            and isinstance(record.get("sha256"), str) and len(record["sha256"]) == 64
            and all(c in "0123456789abcdef" for c in record["sha256"])):
        raise ValueError(f"{record_path}: a damaged download record (not its first download's size and sha256); "
                         "delete it to download the file and record it again")
    return record


@lru_cache(maxsize=64)
def _check_pinned(path: str, size: int, mtime_ns: int, want_size: int, want_sha256: str) -> None:
    """Raise ValueError if the file's size or sha256 differs from its record (cached per size and mtime)."""
    if size != want_size:
        raise ValueError(f"{path}: size differs from its first download (recorded {want_size} bytes, found "
                         f"{size}): the cached file is truncated or changed; delete it to download it again")
    found = file_sha256(path)
    if found != want_sha256:
        raise ValueError(f"{path}: sha256 differs from its first download (recorded {want_sha256}, found {found}): "
                         "the cached file changed; delete it to download it again")


def _stream_to(url: str, dest: str, progress: bool | None, storage_options: dict | None,
               max_bytes: int | None = None) -> tuple[str, int]:
    """Copy `url` to `dest` in 1 MiB blocks with a progress bar; (sha256, size). OSError if the stream ends
    before the size the server announced (or breaks), or runs past max_bytes (announced so: nothing is fetched)."""
    from tqdm import tqdm
    check_protocol(url)
    fs, fs_path = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
    try:
        expected = fs.size(fs_path)
    except (OSError, NotImplementedError):
        expected = None
    if max_bytes is not None and expected is not None and expected > max_bytes:
        raise OSError(f"{url}: {expected} bytes, larger than the {max_bytes} such a file may have: not fetched")
    kwargs = {"block_size": 0} if protocol(url) in ("http", "https") else {}   # http: stream, no range requests
    h, n = hashlib.sha256(), 0
    name = url.rsplit("/", 1)[-1]
    try:
        with fs.open(fs_path, "rb", **kwargs) as src, open(dest, "wb") as out, \
                tqdm(total=expected, unit="B", unit_scale=True, desc=name, leave=False,
                     disable=not os.isatty(2) if progress is None else not progress) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                out.write(block)
                n += len(block)
                bar.update(len(block))
                if max_bytes is not None and n > max_bytes:
                    break
    except Exception as e:  # noqa: BLE001 - aiohttp, botocore, ... : one clear error naming the file
        raise OSError(f"{url}: download failed after {n} bytes"
                      + (f" of {expected}" if expected else "") + f": {type(e).__name__}: {e}") from e
    if max_bytes is not None and n > max_bytes:
        raise OSError(f"{url}: larger than the {max_bytes} bytes such a file may have: not fetched")
    if expected is not None and n != expected:
        raise OSError(f"{url}: download truncated: got {n} of {expected} bytes")
    return h.hexdigest(), n
