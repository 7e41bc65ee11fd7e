"""Finalize: from what a run staged to the final output. No Beam import.

It runs in the launching process once the runner has finished, and reads back what the workers staged
under <out>/_staging/<run key>/ (transforms/write.py): commit records with their shard files, dead letters,
per-input-file record counts. So the output depends on the data alone, not on runner features (side
inputs, metrics, outputs of finish_bundle), and a retried or recomputed bundle cannot change it: of
overlapping commit records one disjoint set is kept, duplicate dead letters are dropped, counts are
one object per input file.

- plan_from_staging(): that reading, checked: every selected shard's files are there and every sentence
  id any record names is covered (else Incomplete: the missing sentences are embedded by another round).
- finalize(): dead letters written as final-size files, the run report (report.html, from the commit
  records and the staged run statistics: transforms/report.py) and metrics.prom (the manifest's counts and
  the stage times: formats/metrics.py), then the plan (finalize.json: every move
  and the manifest) before the first move, then complete_finalize().
- complete_finalize(): the moves not yet done, manifest.json, removal of the staging folder, the
  `register` hook when given (--iceberg-table: the Parquet shards added to an Iceberg table, idempotent),
  _SUCCESS last. Idempotent, so a finalize killed at any point is finished by running the plan again.
- plan_consistent() / roll_back(): a plan one of whose files is gone from both its staged and its final
  name (deleted by hand, or by a run that ignored the lease) is rolled back: the files already moved go
  back to their staged names and the plan is dropped, so the next round resumes from the commit records
  whose files are all present and embeds the rest again.
- clear_final(): removes only the final-name files the pipeline can show it wrote (owned_final_names: what
  its manifest lists, what a plan moved), the proof (manifest.json, the plans) last.
No final-named data file appears before the plan is complete and consistent. `fence` (the lease's
check_held: fsio/lease.py) runs before each irreversible step (each move, the manifest, the staging removal,
the register hook, _SUCCESS): a run that lost its lease stops there (RetryLater) and changes nothing more.
"""
from __future__ import annotations

import json
import logging
import posixpath
import time
from dataclasses import dataclass, field
from typing import Callable

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.layout import (COUNTS, DEAD, DEAD_LETTERS, MANIFEST, METRICS, PLAN, RECORDS, REPORT, SHARD_FOLDERS,
                            STAGING, STATS, SUCCESS, DeadLetter, ShardInfo)
from elmo_pipeline.formats.metrics import metrics_text
from elmo_pipeline.fsio import atomic_write, is_local_fs, makedirs, move, remove_temp_files, url_fs
from elmo_pipeline.fsio.lease import RetryLater
from elmo_pipeline.transforms.faults import crash_point
from elmo_pipeline.transforms.stats import STAGES, merge_stats

logger = logging.getLogger("elmo-pipeline.finalize")
DEAD_LETTERS_PER_FILE = 100_000


class Incomplete(RuntimeError):
    """The staging folder does not (yet) hold every sentence: another round must embed what is missing."""


@dataclass
class Staged:
    """What plan_from_staging() found: the shards to publish, dead letters (no duplicates), summed counts;
    for the run report, the shards' commit records and the staged run statistics (transforms/stats.py)."""
    shards: list[ShardInfo]
    dead: list[DeadLetter]
    counts: dict
    records: list[dict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)


def select_records(fs, st: str, present: set[str]) -> tuple[list[dict], list[str], set[str]]:
    """(records, their paths, ids of every record) from <st>/committed/: a pairwise-disjoint set of commit
    records whose files are all present, first come first kept in name order (a retried bundle's record
    overlapping one already kept is left out)."""
    rec_dir = posixpath.join(st, RECORDS)
    names = sorted(p for p in present if p.startswith(rec_dir + "/") and p.endswith(".json"))
    contents = fs.cat(names, on_error="omit") if names else {}     # concurrent GETs on object stores
    records, paths, done, named = [], [], set(), set()
    for path in names:
        try:
            rec = json.loads(contents[path])
            ids = layout.record_ids(rec)
        except (KeyError, ValueError):
            continue
        named.update(ids)
        files = [posixpath.join(st, f) for f in rec.get("files", {}).values()]
        if not all(f in present for f in files) or done.intersection(ids):
            continue
        done.update(ids)
        records.append(rec)
        paths.append(path)
    return records, paths, named


def plan_from_staging(staging: str, files: list[str], storage_options: dict | None = None) -> Staged:
    """Read and check what the run staged (see the module docstring). Incomplete when a sentence some record
    names is in no selected record, or an input file has no counts."""
    fs, st = url_fs(staging, storage_options)
    fs.invalidate_cache()
    present = set(fs.find(st))
    records, _, named = select_records(fs, st, present)
    covered = {i for r in records for i in layout.record_ids(r)}
    if named - covered:
        raise Incomplete(f"{len(named - covered)} sentence(s) are only in shards whose files are gone or that "
                         "overlap others")
    counts_dir = posixpath.join(st, COUNTS) + "/"
    count_files = sorted(p for p in present if p.startswith(counts_dir) and p.endswith(".json"))
    per_file = {c["url"]: c for c in map(json.loads, fs.cat(count_files).values())} if count_files else {}
    if set(files) - set(per_file):
        raise Incomplete(f"{len(set(files) - set(per_file))} input file(s) have no record counts")
    counts = {k: sum(c[k] for c in per_file.values()) for k in ("input_records", "blank_records")}
    dead_dir = posixpath.join(st, DEAD) + "/"
    dead_files = sorted(p for p in present if p.startswith(dead_dir) and p.endswith(".jsonl"))
    letters = {DeadLetter.from_json(line) for data in (fs.cat(dead_files).values() if dead_files else ())
               for line in data.decode("utf-8").splitlines() if line}
    # a sentence both written and dead-lettered (an embedding failure that a retry did not repeat): written wins
    letters = sorted((d for d in letters if d.level != "sentence" or d.id not in covered),
                     key=lambda d: (d.id, d.level, d.reason, d.excerpt))
    stats_dir = posixpath.join(st, STATS) + "/"
    stats_files = sorted(p for p in present if p.startswith(stats_dir) and p.endswith(".json"))
    stats = [json.loads(v) for v in fs.cat(stats_files).values()] if stats_files else []
    return Staged([ShardInfo.from_record(r, st) for r in records], letters, counts, records, stats)


def finalize(output: str, staging: str, staged: Staged, manifest: dict, storage_options: dict | None = None,
             register: Callable[[dict], None] | None = None, run_seconds: float | None = None,
             fence: Callable[[], None] | None = None) -> dict:
    """Publish `staged`: dead letters as files of at most DEAD_LETTERS_PER_FILE (sorted by id), the run
    report (report.html; `run_seconds`: the run's wall time so far, for it) and metrics.prom, then the plan (finalize.json:
    every move and `manifest` completed with counts and the shard list), then complete_finalize() (with
    `register` and `fence`). Returns the manifest."""
    fs, _ = url_fs(output, storage_options)
    _, st = url_fs(staging, storage_options)
    dead = []
    for n, i in enumerate(range(0, len(staged.dead), DEAD_LETTERS_PER_FILE)):
        part = staged.dead[i: i + DEAD_LETTERS_PER_FILE]
        path = posixpath.join(st, f"dead_letters-{n:05d}.jsonl")
        atomic_write(fs, path, "".join(d.to_json() + "\n" for d in part).encode("utf-8"))
        dead.append(ShardInfo({DEAD_LETTERS: path}, len(part), 0, part[0].id, extra=layout.count_dead_letters(part)))
    m = json.loads(json.dumps(manifest, default=str))
    counts = m.setdefault("counts", {})
    counts.update(layout.record_counts(staged.counts, dead))
    counts["documents"] = counts["input_records"] - counts["blank_records"] - counts["record_dead_letters"]
    m, moves = layout.complete_manifest(m, staged.shards, dead)
    makedirs(fs, st)
    try:            # an extra: a report that cannot be built must not cost the run its output
        from elmo_pipeline.transforms.report import build_report
        page = build_report(m, staged.records, staged.stats, run_seconds)
    except Exception:  # noqa: BLE001
        logger.exception("could not build the run report; the output is complete without it")
    else:
        atomic_write(fs, posixpath.join(st, REPORT), page.encode("utf-8"))
        moves.append([posixpath.join(st, REPORT), REPORT])
        m["report"] = REPORT
    m["metrics"] = METRICS      # the manifest's counts, so written from it once it is complete
    seconds = merge_stats(staged.stats)["seconds"]
    text = metrics_text(m, output, {k: seconds.get(k, 0.0) for k in STAGES}, run_seconds,
                        time.time())
    atomic_write(fs, posixpath.join(st, METRICS), text.encode("utf-8"))
    moves.append([posixpath.join(st, METRICS), METRICS])
    (fence or _unfenced)()
    atomic_write(fs, posixpath.join(st, PLAN), json.dumps({"moves": moves, "manifest": m}).encode())
    complete_finalize(output, staging, storage_options, register, fence)
    return m


def _unfenced() -> None:
    """No lease to check (a finalize called outside a run: tests, tools)."""


def read_plan(fs, st: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(posixpath.join(st, PLAN)))
    except FileNotFoundError:
        return None


def plan_consistent(fs, root: str, st: str, plan: dict) -> bool:
    """True when every move of `plan` still has its file, under the staged or the final name."""
    staged = set(fs.find(st)) if fs.exists(st) else set()
    return all(src in staged or fs.exists(posixpath.join(root, rel)) for src, rel in plan["moves"])


def roll_back(fs, root: str, st: str, plan: dict) -> None:
    """Undo a plan that cannot be completed: files already moved go back to their staged names (a copy left
    at the final name by an object-store move cut short is removed), the plan and manifest.json are removed
    (their shards' commit records then decide what is kept)."""
    staged = set(fs.find(st))
    for src, rel in plan["moves"]:
        dst = posixpath.join(root, rel)
        if fs.exists(dst):
            if src in staged:
                fs.rm_file(dst)
            else:
                move(fs, dst, src)
    for p in (posixpath.join(root, MANIFEST), posixpath.join(st, PLAN)):
        if fs.exists(p):
            fs.rm_file(p)


def complete_finalize(output: str, staging: str, storage_options: dict | None = None,
                      register: Callable[[dict], None] | None = None,
                      fence: Callable[[], None] | None = None) -> dict | None:
    """Carry out (again) the finalize plan in `staging`: every move not yet done, manifest.json, removal of
    the staging folder, then register(manifest) when given (every file is in place; it must be idempotent:
    a run killed after it calls it again), _SUCCESS last; fence() before each of these steps (RetryLater
    when the lease is lost). Without a plan (already removed), only the last steps. Returns the manifest
    written (or found), or None."""
    fence = fence or _unfenced
    fs, root = url_fs(output, storage_options)
    _, st = url_fs(staging, storage_options)
    staged = set(fs.find(st)) if fs.exists(st) else set()     # one listing instead of a request per file
    plan = read_plan(fs, st) if posixpath.join(st, PLAN) in staged else None
    if plan is not None:
        for src, rel in plan["moves"]:
            dst = posixpath.join(root, rel)
            if src in staged:                # not moved yet (or copied but not deleted, on an object store)
                fence()
                makedirs(fs, posixpath.dirname(dst))
                move(fs, src, dst)
            elif not fs.exists(dst):
                raise RetryLater(f"finalize: staged file {src} is gone and {dst} was never written; "
                                        "rerun the same command: it re-embeds that shard")
            crash_point("finalize_move")
        fence()
        atomic_write(fs, posixpath.join(root, MANIFEST), layout.manifest_bytes(plan["manifest"]))
        crash_point("finalize_manifest")
    if fs.exists(st):
        fence()
        fs.rm(st, recursive=True)
    staging_parent = posixpath.join(root, STAGING)
    if fs.exists(staging_parent) and not fs.ls(staging_parent):
        fs.rm(staging_parent, recursive=True)
    crash_point("finalize_cleanup")
    manifest = plan["manifest"] if plan else layout.read_manifest(fs, root)
    if register is not None and manifest is not None:
        crash_point("register")            # just before the table is looked at and the files added
        fence()
        register(manifest)
        crash_point("registered")          # added, _SUCCESS not yet written
    fence()
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))
    atomic_write(fs, posixpath.join(root, SUCCESS), b"")
    return manifest


def staged_plans(fs, root: str) -> dict[str, dict]:
    """{staging folder: its finalize plan} of every run under <root>/_staging/ whose Finalize started (a plan
    that does not parse is left out)."""
    parent = posixpath.join(root, STAGING)
    if not fs.exists(parent):
        return {}
    plans = {}
    for entry in fs.ls(parent, detail=True):
        if entry["type"] != "directory":
            continue
        try:
            plan = read_plan(fs, entry["name"].rstrip("/"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(plan, dict) and isinstance(plan.get("moves"), list):
            plans[entry["name"].rstrip("/")] = plan
    return plans


def plan_names(plan: dict) -> set[str]:
    """The final names (relative to the output folder) that a finalize plan moves files to."""
    return {m[1] for m in plan["moves"] if isinstance(m, list) and len(m) == 2 and layout.is_final_name(m[1])}


def owned_final_names(fs, root: str) -> set[str]:
    """Names (relative to `root`) of final-name files the pipeline can show it wrote there: what its
    manifest.json lists, with manifest.json and _SUCCESS, and what the finalize plans under _staging/ move
    there (formats/layout.py, ownership)."""
    names = set()
    manifest = layout.read_manifest(fs, root)
    if manifest is not None:
        names |= layout.listed_names(manifest) | {MANIFEST, SUCCESS}
    for plan in staged_plans(fs, root).values():
        names |= plan_names(plan)
    return names


def files_under(fs, root: str, folders: tuple[str, ...]) -> set[str]:
    """Names (relative to `root`) of the files under the given subfolders of `root` (one listing each)."""
    found = set()
    for sub in folders:
        path = posixpath.join(root, sub)
        if fs.isdir(path):
            found.update(posixpath.relpath(p, root) for p in fs.find(path))
    return found


def clear_final(fs, root: str, keep: set[str] = frozenset()) -> None:
    """Remove the final-name files the pipeline wrote under `root` (owned_final_names), but those in `keep`:
    _SUCCESS first, manifest.json last (until then it shows whose the rest are), then shard folders left
    empty and the temporary files of manifest.json and _SUCCESS. Files of unknown origin stay."""
    owned = owned_final_names(fs, root) - set(keep)
    present = files_under(fs, root, SHARD_FOLDERS) | {n for n in (SUCCESS, MANIFEST, REPORT, METRICS)
                                                       if fs.exists(posixpath.join(root, n))}
    data = sorted((owned & present) - {SUCCESS, MANIFEST})
    for group in ([SUCCESS], data, [MANIFEST]):
        paths = [posixpath.join(root, n) for n in group if n in owned and n in present]
        if paths:
            fs.rm(paths)
    for sub in SHARD_FOLDERS:
        path = posixpath.join(root, sub)
        if is_local_fs(fs) and fs.isdir(path) and not fs.ls(path):
            fs.rmdir(path)
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))
