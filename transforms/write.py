"""Writing embedded sentences: Parquet (sentence or token rows) and HDF5 shards, staged then committed.

No Beam import. Layout of an output folder <out>:
  parquet/part-00000-of-00002.parquet   hdf5/part-00000-of-00002.hdf5   (same sentences in shard i)
  dead_letters/part-00000-of-00001.jsonl   manifest.json (written after all shards)   _SUCCESS (last)
Shards are written under <out>/_staging/<run key>/ first, each followed by a commit record
(committed/<name>.json, written atomically after the shard's files: a staged file without one is
garbage). finalize() writes a plan (finalize.json: every move and the manifest), then moves the files to
their final names, writes manifest.json, removes the staging folder and writes _SUCCESS last; a rerun
completes an interrupted plan (transforms/resume.py). Readers that trust the manifest see complete
shards or nothing: every file appears under its final name whole (a rename, or one object PUT/COPY).
"""
from __future__ import annotations

import json
import os
import posixpath
import tempfile
import uuid
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from transforms.batching import Item
from transforms.faults import crash_point

SCHEMA_VERSION = 1
FORMATS = ("parquet", "hdf5")
PARQUET_LAYOUTS = ("sentence", "token")
ID_COLUMNS = ["id", "doc_id", "sentence_index", "token_index"]
RECORDS = "committed"      # <staging>/committed/<shard name>.json: the shard is complete
PLAN = "finalize.json"     # <staging>/finalize.json: the moves and manifest of a started finalize


@dataclass
class Row:
    """One embedded sentence: the item, Parquet column arrays [(T, D_k)], HDF5 array (AllenNLP layout)."""
    item: Item
    columns: list[np.ndarray]
    h5: np.ndarray | None = None


@dataclass
class ShardInfo:
    """A staged shard: staged file URLs by format, counts, and the smallest sentence id (for naming)."""
    files: dict[str, str]
    sentences: int
    tokens: int
    first_id: str
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: dict, staging_root: str) -> "ShardInfo":
        """The ShardInfo of a commit record (its file names are relative to the staging folder)."""
        files = {fmt: posixpath.join(staging_root, name) for fmt, name in record["files"].items()}
        return cls(files, record["sentences"], record["tokens"], record["first_id"])


def _vectors(arrays: list[np.ndarray], dim: int, dtype: str) -> pa.FixedSizeListArray:
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, dtype)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(dtype, copy=False)), dim)


def _list_of(values: pa.Array, lengths: list[int]) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def sentence_table(rows: list[Row], columns: list[tuple[str, int]], dtype: str) -> pa.Table:
    """One row per sentence: id, doc_id, sentence_index, tokens, token_offsets, one list<fixed_size_list> per layer."""
    lengths = [len(r.item.tokens) for r in rows]
    offsets = np.array([o for r in rows for o in r.item.offsets], dtype=np.int32).reshape(-1, 2)
    data = {
        "id": pa.array([r.item.id for r in rows], pa.string()),
        "doc_id": pa.array([r.item.doc_id for r in rows], pa.string()),
        "sentence_index": pa.array([r.item.index for r in rows], pa.int32()),
        "tokens": _list_of(pa.array([t for r in rows for t in r.item.tokens], pa.string()), lengths),
        "token_offsets": _list_of(pa.FixedSizeListArray.from_arrays(pa.array(offsets.reshape(-1)), 2), lengths),
    }
    for k, (name, dim) in enumerate(columns):
        data[name] = _list_of(_vectors([r.columns[k] for r in rows], dim, dtype), lengths)
    return pa.table(data)


def token_table(rows: list[Row], columns: list[tuple[str, int]], dtype: str) -> pa.Table:
    """One row per token: id (sentence), doc_id, sentence_index, token_index, token, start, end, one fixed_size_list per layer."""
    n = [len(r.item.tokens) for r in rows]
    offsets = np.array([o for r in rows for o in r.item.offsets], dtype=np.int32).reshape(-1, 2)
    data = {
        "id": pa.array([r.item.id for r, k in zip(rows, n) for _ in range(k)], pa.string()),
        "doc_id": pa.array([r.item.doc_id for r, k in zip(rows, n) for _ in range(k)], pa.string()),
        "sentence_index": pa.array(np.repeat([r.item.index for r in rows], n).astype(np.int32)),
        "token_index": pa.array(np.concatenate([np.arange(k, dtype=np.int32) for k in n]) if rows else np.zeros(0, np.int32)),
        "token": pa.array([t for r in rows for t in r.item.tokens], pa.string()),
        "start": pa.array(offsets[:, 0]),
        "end": pa.array(offsets[:, 1]),
    }
    for k, (name, dim) in enumerate(columns):
        data[name] = _vectors([r.columns[k] for r in rows], dim, dtype)
    return pa.table(data)


def write_parquet(table: pa.Table, f, row_group_bytes: int) -> None:
    """zstd; dictionary and statistics on id columns only; row groups of about `row_group_bytes`."""
    ids = [c for c in ID_COLUMNS + ["token"] if c in table.column_names]
    rows = max(1, int(row_group_bytes // max(1, table.nbytes / max(1, table.num_rows))))
    with pq.ParquetWriter(f, table.schema, compression="zstd", use_dictionary=["doc_id"],
                          write_statistics=ids) as w:
        w.write_table(table, row_group_size=rows)


def hdf5_key(sentence_id: str) -> str:
    """HDF5 dataset name of a sentence id: '%' -> '%25', '/' -> '%2F' (a '/' would make groups)."""
    return sentence_id.replace("%", "%25").replace("/", "%2F")


def write_hdf5(rows: list[Row], path: str) -> None:
    """AllenNLP layout: one float dataset per sentence, keyed by hdf5_key(sentence id)."""
    import h5py
    with h5py.File(path, "w") as f:
        for r in rows:
            f.create_dataset(hdf5_key(r.item.id), data=r.h5)


def url_fs(url: str, storage_options: dict | None = None):
    """(fsspec filesystem, path) for a local path or URL; storage_options is {protocol: {...}}."""
    proto = url.split("://", 1)[0] if "://" in url else "file"
    return fsspec.core.url_to_fs(url, **dict((storage_options or {}).get(proto, {})))


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def makedirs(fs, path: str) -> None:
    """Create a local folder; nothing on object stores (no folders there, and each call costs requests)."""
    if is_local(fs):
        fs.makedirs(path, exist_ok=True)


def move(fs, src: str, dst: str) -> None:
    """A local rename (atomic), or an object store's server-side copy then delete (the copy appears whole)."""
    if is_local(fs):
        fs.mv(src, dst)
    else:
        fs.cp_file(src, dst)
        fs.rm_file(src)


def atomic_write(fs, path: str, data: bytes) -> None:
    """Write `path` so that no reader (and no crash) ever leaves a partial file under that name:
    a local file is written beside it and renamed; an object store PUT is atomic by itself."""
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def stage_shard(rows: list[Row], staging: str, formats: list[str], layout: str, columns: list[tuple[str, int]],
                dtype: str, row_group_bytes: int, storage_options: dict | None = None) -> ShardInfo:
    """Write one shard of `rows` (sorted by id) under the staging URL (uuid names), then its commit record
    (committed/<name>.json: file names, counts, sentence ids); return what was written."""
    rows = sorted(rows, key=lambda r: r.item.id)
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, root)
    name = uuid.uuid4().hex
    files = {}
    if "parquet" in formats:
        table = (sentence_table if layout == "sentence" else token_table)(rows, columns, dtype)
        files["parquet"] = posixpath.join(root, name + ".parquet")
        with fs.open(files["parquet"], "wb") as f:
            write_parquet(table, f, row_group_bytes)
            crash_point("stage_shard")
    if "hdf5" in formats:
        files["hdf5"] = posixpath.join(root, name + ".hdf5")
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, name + ".hdf5")
            write_hdf5(rows, local)
            fs.put_file(local, files["hdf5"])
    info = ShardInfo(files, len(rows), sum(len(r.item.tokens) for r in rows), rows[0].item.id)
    record = {"files": {fmt: posixpath.basename(p) for fmt, p in files.items()}, "sentences": info.sentences,
              "tokens": info.tokens, "first_id": info.first_id, "ids": [r.item.id for r in rows]}
    makedirs(fs, posixpath.join(root, RECORDS))
    atomic_write(fs, posixpath.join(root, RECORDS, name + ".json"), json.dumps(record).encode())
    crash_point("commit")
    return info


def stage_dead_letters(letters: list, staging: str, storage_options: dict | None = None) -> ShardInfo:
    """Write dead letters (objects with to_json()) as one staged JSONL file."""
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, root)
    path = posixpath.join(root, uuid.uuid4().hex + ".jsonl")
    with fs.open(path, "wt", encoding="utf-8") as f:
        for d in letters:
            f.write(d.to_json() + "\n")
    return ShardInfo({"dead_letters": path}, len(letters), 0, min(d.id for d in letters),
                     extra={"sentence_level": sum(1 for d in letters if "#" in d.id)})


FINAL_NAMES = ("parquet", "hdf5", "dead_letters", "manifest.json", "_SUCCESS")


def clear_final(fs, root: str) -> None:
    """Remove the final-name outputs (shard folders, manifest.json, _SUCCESS) under `root`."""
    for sub in FINAL_NAMES:
        p = posixpath.join(root, sub)
        if fs.exists(p):
            fs.rm(p, recursive=True)
    _remove_temp_files(fs, root)


def _remove_temp_files(fs, root: str) -> None:
    """atomic_write's temporary files left by a process killed between writing and renaming (local only)."""
    if is_local(fs):
        for name in ("manifest.json", "_SUCCESS"):
            for p in fs.glob(posixpath.join(root, name + ".tmp-*")):
                fs.rm_file(p)


def finalize(output: str, staging: str, shards: list[ShardInfo], dead: list[ShardInfo], manifest: dict,
             storage_options: dict | None = None) -> dict:
    """Move committed staged files to part-NNNNN-of-NNNNN names; write manifest.json, then _SUCCESS.

    `manifest` is completed with counts and the shard list (paths relative to `output`). The moves and the
    manifest are first written as a plan (<staging>/finalize.json); complete_finalize() carries it out and
    is idempotent, so a finalize killed at any point is finished by running the plan again."""
    fs, root = url_fs(output, storage_options)
    _, st = url_fs(staging, storage_options)
    shards = sorted(shards, key=lambda s: s.first_id)
    dead = sorted(dead, key=lambda s: s.first_id)
    listing, moves = [], []
    for i, s in enumerate(shards):
        entry = {"sentences": s.sentences, "tokens": s.tokens}
        for fmt, src in sorted(s.files.items()):
            rel = f"{fmt}/part-{i:05d}-of-{len(shards):05d}.{fmt}"
            moves.append([src, rel])
            entry[fmt] = rel
        listing.append(entry)
    dead_files = []
    for i, s in enumerate(dead):
        rel = f"dead_letters/part-{i:05d}-of-{len(dead):05d}.jsonl"
        moves.append([s.files["dead_letters"], rel])
        dead_files.append({"path": rel, "records": s.sentences})
    counts = manifest.setdefault("counts", {})
    counts["sentences_written"] = sum(s.sentences for s in shards)
    counts["tokens_written"] = sum(s.tokens for s in shards)
    counts["dead_letters"] = sum(s.sentences for s in dead)
    counts["dead_letter_sentences"] = sum(s.extra.get("sentence_level", 0) for s in dead)
    counts["sentences"] = counts["sentences_written"] + counts["dead_letter_sentences"]
    manifest.update(schema_version=SCHEMA_VERSION, shards=listing, dead_letter_files=dead_files)
    makedirs(fs, st)
    atomic_write(fs, posixpath.join(st, PLAN), json.dumps({"moves": moves, "manifest": manifest}).encode())
    complete_finalize(output, staging, storage_options)
    return manifest


def complete_finalize(output: str, staging: str, storage_options: dict | None = None) -> dict | None:
    """Carry out (again) the finalize plan in `staging`: every move not yet done, manifest.json, removal of
    the staging folder, _SUCCESS last. Without a plan (already removed), only the last two steps. Returns
    the manifest written, or None when there was no plan."""
    fs, root = url_fs(output, storage_options)
    _, st = url_fs(staging, storage_options)
    staged = set(fs.find(st)) if fs.exists(st) else set()     # one listing instead of a request per file
    plan_path = posixpath.join(st, PLAN)
    plan = json.loads(fs.cat_file(plan_path)) if plan_path in staged else None
    if plan is not None:
        for src, rel in plan["moves"]:
            dst = posixpath.join(root, rel)
            if src in staged:                # not moved yet (or copied but not deleted, on an object store)
                makedirs(fs, posixpath.dirname(dst))
                move(fs, src, dst)
            elif not fs.exists(dst):
                raise FileNotFoundError(f"finalize: staged file {src} is gone and {dst} was never written")
            crash_point("finalize_move")
        atomic_write(fs, posixpath.join(root, "manifest.json"),
                     json.dumps(plan["manifest"], indent=1, sort_keys=True).encode())
        crash_point("finalize_manifest")
    if fs.exists(st):
        fs.rm(st, recursive=True)
    staging_parent = posixpath.join(root, "_staging")
    if fs.exists(staging_parent) and not fs.ls(staging_parent):
        fs.rm(staging_parent, recursive=True)
    crash_point("finalize_cleanup")
    _remove_temp_files(fs, root)
    atomic_write(fs, posixpath.join(root, "_SUCCESS"), b"")
    return plan["manifest"] if plan else None
