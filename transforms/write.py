"""Staging shards and committing them: the writer's side of the output folder (formats.layout). No Beam import.

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

from formats import layout
from formats.hdf5 import write_hdf5
from formats.layout import DEAD_LETTERS, FINAL_NAMES, MANIFEST, PLAN, RECORDS, SUCCESS, ShardInfo
from formats.parquet import build_table, write_parquet
from storage import atomic_write, makedirs, move, remove_temp_files, url_fs
from transforms.faults import crash_point
from transforms.records import Row


def stage_shard(rows: list[Row], staging: str, formats: list[str], layout_: str, columns: list[tuple[str, int]],
                dtype: str, row_group_bytes: int, storage_options: dict | None = None) -> ShardInfo:
    """Write one shard of `rows` (sorted by id) under the staging URL (uuid names), then its commit record
    (committed/<name>.json: file names, counts, sentence ids); return what was written."""
    rows = sorted(rows, key=lambda r: r.item.id)
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, root)
    name = uuid.uuid4().hex
    files = {}
    if "parquet" in formats:
        table = build_table(rows, layout_, columns, dtype)
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
    makedirs(fs, posixpath.join(root, RECORDS))
    atomic_write(fs, posixpath.join(root, RECORDS, name + ".json"),
                 json.dumps(info.record([r.item.id for r in rows])).encode())
    crash_point("commit")
    return info


def stage_dead_letters(letters: list[layout.DeadLetter], staging: str, storage_options: dict | None = None) -> ShardInfo:
    """Write dead letters as one staged JSONL file; its ShardInfo carries their counts (extra)."""
    fs, root = url_fs(staging, storage_options)
    makedirs(fs, root)
    path = posixpath.join(root, uuid.uuid4().hex + ".jsonl")
    with fs.open(path, "wt", encoding="utf-8") as f:
        for d in letters:
            f.write(d.to_json() + "\n")
    return ShardInfo({DEAD_LETTERS: path}, len(letters), 0, min(d.id for d in letters),
                     extra=layout.count_dead_letters(letters))


def clear_final(fs, root: str) -> None:
    """Remove the final-name outputs (shard folders, manifest.json, _SUCCESS) under `root`."""
    for sub in FINAL_NAMES:
        p = posixpath.join(root, sub)
        if fs.exists(p):
            fs.rm(p, recursive=True)
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))


def finalize(output: str, staging: str, shards: list[ShardInfo], dead: list[ShardInfo], manifest: dict,
             storage_options: dict | None = None) -> dict:
    """Move committed staged files to part-NNNNN-of-NNNNN names; write manifest.json, then _SUCCESS.

    `manifest` is completed with counts and the shard list (formats.layout.complete_manifest). The moves and
    the manifest are first written as a plan (<staging>/finalize.json); complete_finalize() carries it out and
    is idempotent, so a finalize killed at any point is finished by running the plan again."""
    fs, _ = url_fs(output, storage_options)
    _, st = url_fs(staging, storage_options)
    manifest, moves = layout.complete_manifest(manifest, shards, dead)
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
        atomic_write(fs, posixpath.join(root, MANIFEST), layout.manifest_bytes(plan["manifest"]))
        crash_point("finalize_manifest")
    if fs.exists(st):
        fs.rm(st, recursive=True)
    staging_parent = posixpath.join(root, layout.STAGING)
    if fs.exists(staging_parent) and not fs.ls(staging_parent):
        fs.rm(staging_parent, recursive=True)
    crash_point("finalize_cleanup")
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))
    atomic_write(fs, posixpath.join(root, SUCCESS), b"")
    return plan["manifest"] if plan else None
