"""Where an output's files go: one fsspec filesystem (a local folder or an object store) and the fence checked
before every write. Local and remote stores differ only here; the format writers (formats/parquet.py,
formats/arrow.py, formats/hdf5.py) are handed a stream from open() or bytes for put(). Each file's size and
SHA-256 are taken as it is written (one pass, no second read): `Sink.written`, the record a manifest lists and a
reader checks. No Beam import.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from contextlib import contextmanager
from typing import Callable

import pyarrow as pa

from elmo_pipeline.formats.layout import SUCCESS
from elmo_pipeline.fsio import atomic_write, is_local_fs, makedirs, move, release_written, url_fs


def placed_there(path: str) -> FileExistsError:
    """The error for a file at one of the output's final names that this pipeline did not write (placed there while a
    run went on): nothing is written over it."""
    return FileExistsError(f"{path}: a file this pipeline did not write is there (placed while it ran?); nothing is "
                           "overwritten. Move it away, then rerun the same command")


def success_marker(fs, root: str) -> bool | None:
    """What is at `root`/_SUCCESS: None when nothing; True for an empty regular file (the marker this pipeline
    writes, or one that says the same); False for anything else (bytes in it, a link, a FIFO, a folder): placed
    there by someone else, so no finished run is read from it and nothing is written over it."""
    path = posixpath.join(root, SUCCESS)
    try:
        if is_local_fs(fs):
            st = os.lstat(path)
            return stat.S_ISREG(st.st_mode) and st.st_size == 0
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return info.get("type") == "file" and info.get("size") == 0


def unfenced() -> None:
    """No lease to check (writes outside a run: tests, tools)."""


def file_record(size: int, sha256: str) -> dict:
    """What a manifest records of one file: {"bytes": size, "sha256": hex digest}."""
    return {"bytes": size, "sha256": sha256}


class DigestWriter:
    """A write-through stream that counts and hashes (SHA-256) every byte handed to `raw` on its way."""

    def __init__(self, raw):
        self.raw, self.hash, self.size, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def close(self) -> None:        # the Sink closes raw once the writer is done with the stream
        self.closed = True

    def record(self) -> dict:
        return file_record(self.size, self.hash.hexdigest())


class Sink:
    """Writes under one filesystem. `fence()` runs before each write, move and removal: it raises (output.lease's
    LeaseLost) once the run that writes lost the output's lease, so a fenced-off run writes nothing more."""

    def __init__(self, fs, fence: Callable[[], None] | None = None, root: str | None = None):
        self.fs, self.fence, self.root = fs, fence or unfenced, root
        self.local = is_local_fs(fs)
        self.written: dict[str, dict] = {}      # path -> file_record of what this Sink wrote (moves follow it)

    @classmethod
    def at(cls, url: str, storage_options: dict | None = None, fence: Callable[[], None] | None = None):
        """(Sink, path within its filesystem) of a folder URL or path; every local write, move and removal stays
        inside that folder (check_inside)."""
        fs, root = url_fs(url, storage_options)
        return cls(fs, fence, root), root

    def check_inside(self, *paths: str) -> None:
        """FileExistsError when a local `path` would be reached through a symbolic link below this Sink's folder, or
        is one, or lies outside the folder: checked at the moment of each write, move and removal, since a link
        planted while a run works would otherwise take the write out of the output."""
        if not self.local or self.root is None:
            return
        root = os.path.abspath(self.root)
        for path in paths:
            rel = os.path.relpath(os.path.abspath(path), root)
            if rel == ".." or rel.startswith("../"):
                raise FileExistsError(f"{path}: outside the output folder {root}; nothing is written there")
            here = root
            for part in rel.split(os.sep):
                here = os.path.join(here, part)
                if os.path.islink(here):
                    raise FileExistsError(f"{here}: a symbolic link where this pipeline writes (planted while it ran?);"
                                          " nothing is written through it. Remove the link, then rerun")

    @contextmanager
    def open(self, path: str):
        """A writable binary stream for a new file at `path` (local: Arrow's own file, written without the GIL;
        object stores: one object, visible once the block ends). The file is released to disk when whole."""
        self.fence()
        self.check_inside(path)
        makedirs(self.fs, posixpath.dirname(path))
        if self.local:
            with pa.OSFile(path, "wb") as f:
                stream = DigestWriter(f)
                yield stream
            release_written(self.fs, path)
        else:
            with self.fs.open(path, "wb") as f:
                stream = DigestWriter(f)
                yield stream
        self.written[path] = stream.record()

    def put(self, path: str, data: bytes, create: bool = False) -> None:
        """`data` at `path`, whole or not at all (fsio.atomic_write); create=True: never over a file there (placed
        while the run went on: placed_there)."""
        self.fence()
        self.check_inside(path)
        makedirs(self.fs, posixpath.dirname(path))
        try:
            atomic_write(self.fs, path, data, create=create)
        except FileExistsError:
            raise placed_there(path) from None
        self.written[path] = file_record(len(data), hashlib.sha256(data).hexdigest())

    def move(self, src: str, dst: str) -> None:
        """`src` renamed to `dst` (a file's final name), never over anything there: IsADirectoryError for a local
        folder (a rename would put the file inside it, into a folder this pipeline did not make), FileExistsError
        for a file (placed there while the run went on: fsio.move with replace=False)."""
        self.fence()
        self.check_inside(src, dst)
        makedirs(self.fs, posixpath.dirname(dst))
        self.check_inside(dst)
        if self.local and os.path.isdir(dst):
            raise IsADirectoryError(f"{dst}: a folder where this pipeline writes a file (made while it ran?); nothing "
                                    "is moved into it. Remove it, then rerun")
        try:
            move(self.fs, src, dst, replace=False)
        except FileExistsError:
            raise placed_there(dst) from None
        if src in self.written:
            self.written[dst] = self.written.pop(src)

    def remove(self, paths: list[str] | str, recursive: bool = False) -> None:
        self.fence()
        self.check_inside(*([paths] if isinstance(paths, str) else paths))
        self.fs.rm(paths, recursive=recursive)
