"""One pipeline output folder, opened through its manifest.json: its shards, layers and records. No Beam import.

Only complete, committed shards are read (never files of retried bundles under _staging/). Local paths and
fsspec URLs (s3://, gs://, ...) work; `storage_options` are the fsspec options of the folder's filesystem
(e.g. {"endpoint_url": ...} for s3).
"""
from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from elmo_pipeline.downstream.batching import stack
from elmo_pipeline.downstream.shard_checks import (DamagedOutput, check_arrow_batch, check_file, check_folders,
                                                   check_parquet_counts, check_parquet_pages, check_parquet_schema,
                                                   checked_shards, check_size, checked_files, checked_header,
                                                   shard_entry)
from elmo_pipeline.downstream.shard_readers import (arrow_records, hdf5_records, parquet_meta, parquet_records,
                                      parquet_token_records)
from elmo_pipeline.formats.layout import FORMATS, MANIFEST, read_manifest
from elmo_pipeline.fsio import is_local_fs, keyed, redact, url_fs
from elmo_pipeline.output.names import METRICS, REPORT

RENDERINGS = (REPORT, METRICS)     # recorded files that are renderings of the run, not its data
VERIFY = ("digest", "size")        # ElmoOutput's checks of a shard file before it is read


class ElmoOutput:
    """One pipeline output folder, read through its manifest.json.

    path: the folder (path or URL); storage_options: fsspec options for its filesystem.
    Attributes: manifest, shards (manifest entries), layer_names (['layer_0', 'layer_1', ...] or
    ['average']), layer_dims ({name: stored width}), dim (2P, the width of a record's layers),
    formats, parquet_layout, dtype (of the stored vectors). Formats: parquet, hdf5, arrow (--format arrow;
    downstream/mapped.py reads it without loading it). File names leaving the folder are refused.
    verify: how a shard file is checked against the manifest's record before it is read: "digest" (its size, then
    its SHA-256, read once per process while the file is unchanged: a shard swapped in with the same size is
    refused) or "size" (its size only: for an output validate() has checked and nothing since may have changed).
    """

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None, verify: str = "digest"):
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
        self.path, self.verify = path.rstrip("/"), verify
        self.shown = redact(self.path)          # the path as messages and repr show it: no password, token or signature
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = url_fs(self.path, keyed(self.path, self.storage_options))
        manifest = read_manifest(self.fs, self.root)
        if manifest is None:
            path = posixpath.join(self.root, MANIFEST)
            there = os.path.lexists(path) if is_local_fs(self.fs) else False
            raise FileNotFoundError(f"{self.shown}: " + ("its manifest.json is no pipeline manifest (not a regular file, "
                                                         "or not one this pipeline wrote)" if there else
                                                         "no manifest.json (not a finished pipeline output)"))
        self.manifest = manifest
        where = posixpath.join(self.path, MANIFEST)
        self.shards: list[dict] = checked_shards(where, [shard_entry(f"{where}: shard {i}", s, FORMATS)
                                                         for i, s in enumerate(self.manifest.get("shards", []))],
                                                 FORMATS, self.manifest.get("counts"))
        self.layer_names, self.layer_dims, self.formats, self.parquet_layout = checked_header(where, manifest)
        self.files: dict[str, dict] | None = checked_files(where, manifest)
        # 2P: a layer 0 stored P wide (not --duplicate-layer0) is 2P in a record, and in HDF5 as AllenNLP lays it out
        single = self.manifest.get("duplicate_layer0") is False
        self.dim = max(w * (2 if name == "layer_0" and single else 1) for name, w in self.layer_dims.items())
        self.dtype: str = self.manifest.get("dtype", "float32")
        if self.dtype not in ("float16", "float32"):
            raise DamagedOutput(f"{where}: dtype {self.dtype!r} is neither float16 nor float32")

    def __repr__(self) -> str:
        return (f"ElmoOutput({self.shown!r}: {len(self.shards)} shards, {self.num_sentences} sentences, "
                f"layers {self.layer_names}, dim {self.dim}, formats {self.formats})")

    @property
    def num_sentences(self) -> int:
        return sum(int(s["sentences"]) for s in self.shards)

    def shard_path(self, i: int, fmt: str, check: bool = False, digest: bool | None = None) -> str:
        """Filesystem path (for self.fs) of shard i in format fmt; `check`: checked before it is opened (_check_file:
        a local path a regular file in no linked folder, of the size the manifest's `files` records where it records
        it, and with `digest` (None: self.verify's) of its SHA-256, once per process while unchanged)."""
        if fmt not in self.shards[i]:
            raise ValueError(f"{self.shown}: shard {i} has no {fmt} file (formats: {self.formats})")
        path = posixpath.join(self.root, self.shards[i][fmt])
        if check:
            self._check_file(self.shards[i][fmt], self._record(i, fmt),
                             self.verify == "digest" if digest is None else digest, once=True)
        return path

    def _check_file(self, name: str, record: dict | None, digest: bool, once: bool = False) -> None:
        """check_file of the output's file `name` (relative), its folders first where local (check_folders)."""
        if is_local_fs(self.fs):
            check_folders(self.root, name)
        check_file(self.fs, posixpath.join(self.root, name), record, digest=digest, once=once)

    def _record(self, i: int, fmt: str) -> dict | None:
        """The manifest's record ({"bytes", "sha256"}) of shard i's fmt file; None where it records none."""
        return (self.files or {}).get(self.shards[i][fmt])

    def check_arrow(self, i: int, batch, where: str, full: bool = False, size: int | None = None) -> None:
        """Raise DamagedOutput unless `batch`, shard i's Arrow file (read from `where`), matches the manifest
        (shard_checks.check_arrow_batch); `size`: the file's size as read, first checked against its record."""
        if size is not None:
            check_size(where, size, self._record(i, "arrow"))
        s = self.shards[i]
        check_arrow_batch(batch, where, int(s["tokens"]), int(s["sentences"]), self.dtype, self.layer_dims, full)

    def parquet_check(self, i: int, where: str):
        """check(pf, f, columns) of shard i's Parquet file (pyarrow ParquetFile of file f, read from `where`) against
        the manifest, before a page is read: its schema (check_parquet_schema), its footer's counts
        (check_parquet_counts) and the page headers of the columns to read (check_parquet_pages; None: all)."""
        s = self.shards[i]
        options = self.manifest.get("options")
        cap = options.get("max_record_bytes") if isinstance(options, dict) else None

        def check(pf, f, columns) -> None:
            check_parquet_schema(pf.schema_arrow, where, self.layer_dims, self.dtype, self.parquet_layout)
            check_parquet_counts(pf.metadata, where, int(s["sentences"]), int(s["tokens"]), self.layer_dims,
                                 self.parquet_layout)
            check_parquet_pages(pf, f, where, columns, int(s["sentences"]), int(s["tokens"]), self.layer_dims,
                                cap if type(cap) is int and cap > 0 else None)
        return check

    def hdf5_expect(self, i: int) -> dict:
        """What shard i's HDF5 file must hold: sentences, tokens, layers per dataset, width, dtype."""
        s = self.shards[i]
        return {"sentences": int(s["sentences"]), "tokens": int(s["tokens"]), "dim": self.dim, "dtype": self.dtype,
                "n_layers": len(self.layer_names) if self.manifest.get("hdf5_layout") != "(T, D)" else 1}

    def validate(self) -> None:
        """Where the manifest records files (`files`): every shard file of every format recorded, and every recorded
        file there checked by size and SHA-256, each read once (a file swapped in with the same counts is refused);
        then every shard of every format read through its checks, Arrow with pyarrow's full validation of every
        buffer. DamagedOutput names the first file that does not match the manifest."""
        self._check_records()
        for i in range(len(self.shards)):
            for fmt in self.formats:
                if fmt == "arrow":
                    from elmo_pipeline.downstream.arrow_shards import read_arrow_shard
                    path = self.shard_path(i, fmt, check=True)
                    self.check_arrow(i, read_arrow_shard(self.fs, path), path, full=True)
                else:
                    n = sum(1 for _ in self.iter_shard(i, fmt, stacked=False))
                    if n != int(self.shards[i]["sentences"]):
                        raise DamagedOutput(f"{self.shard_path(i, fmt)}: {n} sentences, the manifest says "
                                            f"{self.shards[i]['sentences']}")

    def _check_records(self) -> None:
        """validate()'s digests: each shard file recorded, each recorded file checked whole (check_file); of the
        recorded files only the run's renderings (report.html, metrics.prom) may be gone (deleted by hand)."""
        if self.files is None:
            return
        shards = {s[fmt] for s in self.shards for fmt in self.formats if fmt in s}
        missing = sorted(shards - set(self.files))
        if missing:
            raise DamagedOutput(f"{posixpath.join(self.root, missing[0])}: not recorded in the manifest "
                                f"({MANIFEST} files)")
        unlisted = sorted(n for n in self.files if n.split("/")[0] in FORMATS and n not in shards)
        if unlisted:            # a shard entry gone from the manifest: its sentences would be missing, unsaid
            raise DamagedOutput(f"{posixpath.join(self.root, unlisted[0])}: recorded in the manifest ({MANIFEST} "
                                "files) but named by no shard entry")
        for name, record in self.files.items():
            path = posixpath.join(self.root, name)
            if name not in RENDERINGS or (os.path.lexists(path) if is_local_fs(self.fs) else self.fs.exists(path)):
                self._check_file(name, record, digest=True)

    def default_format(self) -> str:
        return next((f for f in ("parquet", "hdf5") if f in self.formats), "arrow")

    def check(self, fmt: str | None, layers: Sequence[str] | None) -> tuple[str, list[str]]:
        """(format, layer names) to read: fmt or the default one, layers or all; ValueError if either is
        not in this output."""
        fmt = fmt or self.default_format()
        if fmt not in FORMATS or fmt not in self.formats:
            raise ValueError(f"{self.shown}: format {fmt!r} not written (formats: {self.formats})")
        names = list(layers) if layers else list(self.layer_names)
        missing = [n for n in names if n not in self.layer_names]
        if missing:
            raise ValueError(f"{self.shown}: no layer(s) {missing} (has {self.layer_names})")
        return fmt, names

    def iter_shard(self, i: int, fmt: str | None = None, layers: Sequence[str] | None = None,
                   stacked: bool = True) -> Iterator[dict]:
        """Records of shard i in stored order (sorted by id): dicts with id, doc_id, sentence_index,
        tokens (None for an HDF5-only output) and layers (float32 (L, T, dim)).

        stacked=False: `stored` (the per-layer (T, D_k) arrays as stored: dtype kept, layer 0 maybe P
        wide) instead of `layers`; stack(record["stored"]) makes `layers`."""
        fmt, names = self.check(fmt, layers)
        path = self.shard_path(i, fmt, check=True)
        if fmt == "parquet":
            read = parquet_token_records if self.parquet_layout == "token" else parquet_records
            it = read(self.fs, path, names, self.parquet_check(i, path))
        elif fmt == "arrow":
            it = arrow_records(self.fs, path, names, lambda batch: self.check_arrow(i, batch, path))
        else:
            it = hdf5_records(self.fs, path, [self.layer_names.index(n) for n in names], self._hdf5_meta(i),
                              self.hdf5_expect(i))
        for r in it:
            if stacked:
                r["layers"] = self.stack(r.pop("stored"))
            yield r

    def _hdf5_meta(self, i: int) -> dict[str, tuple] | None:
        """Doc ids, sentence indices and tokens of shard i's sentences from its Parquet twin (None without one)."""
        if "parquet" in self.shards[i] and self.parquet_layout == "sentence":
            path = self.shard_path(i, "parquet", check=True)
            return parquet_meta(self.fs, path, self.parquet_check(i, path))
        return None

    def sentences(self, fmt: str | None = None, layers: Sequence[str] | None = None) -> Iterator[dict]:
        """All records, shard after shard (manifest order), each shard sorted by id."""
        for i in range(len(self.shards)):
            yield from self.iter_shard(i, fmt, layers)

    def stack(self, arrays: list[np.ndarray]) -> np.ndarray:
        """(L, T, dim) float32 from per-layer (T, D_k); a P-wide layer 0 becomes [x, x] (batching.stack)."""
        return stack(arrays, self.dim)


def open_output(source: str | ElmoOutput, storage_options: Mapping[str, Any] | None) -> ElmoOutput:
    """source itself when it is an ElmoOutput, else the output at that path or URL."""
    return source if isinstance(source, ElmoOutput) else ElmoOutput(source, storage_options)


def open_outputs(sources: str | ElmoOutput | Sequence[str | ElmoOutput],
                 storage_options: Mapping[str, Any] | None) -> list[ElmoOutput]:
    """open_output of one source or of each of several."""
    if isinstance(sources, (str, ElmoOutput)):
        sources = [sources]
    return [open_output(s, storage_options) for s in sources]
