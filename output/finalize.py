"""Finalize: from what a run staged to the final output. No Beam import.

It runs in the launching process once the runner has finished, and reads back what the workers staged
under <out>/_staging/<run key>/ (output/staging.py): commit records with their shard files, dead letters,
per-input-file record counts. So the output depends on the data alone, not on runner features (side
inputs, metrics, outputs of finish_bundle), and a retried or recomputed bundle cannot change it: of
overlapping commit records one disjoint set is kept, duplicate dead letters are dropped, counts are
one object per input file.

- plan_from_staging(): that reading, checked: every selected shard's files are there and every sentence
  id any record names is covered (else Incomplete: the missing sentences are embedded by another round).
- finalize(): dead letters written as final-size files, the upsert's document state
  (--iceberg-mode upsert: stage_upsert_state), the run report (report.html, from the commit
  records and the staged run statistics: output/report.py) and metrics.prom (the manifest's counts and
  the stage times: formats/metrics.py), then the plan (finalize.json: every move
  and the manifest) before the first move, then complete_finalize().
- complete_finalize(): the moves not yet done, manifest.json, removal of the staging folder, the
  `register` hook when given (--iceberg-table: the Parquet shards added to an Iceberg table, idempotent),
  _SUCCESS last. Idempotent, so a finalize killed at any point is finished by running the plan again.
- plan_consistent() / roll_back(): a plan one of whose files is gone from both its staged and its final
  name (deleted by hand, or by a run that ignored the lease) is rolled back: the files already moved go
  back to their staged names and the plan is dropped, so the next round resumes from the commit records
  whose files are all present and embeds the rest again.
The manifest is assembled and written by output/manifest.py; only what the pipeline owns is ever removed
(output/ownership.py). No final-named data file appears before the plan is complete and consistent. Every write, move and removal
goes through a Sink (output/sink.py) whose fence is the lease's check_held (output/lease.py); the register hook
is fenced too: a run that lost its lease stops there (LeaseLost) and changes nothing more.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from elmo_pipeline.formats import layout
from elmo_pipeline.formats.layout import DOC_HASHES, MANIFEST, SUCCESS, DeadLetter, ShardInfo
from elmo_pipeline.formats.metrics import metrics_text
from elmo_pipeline.fsio import (NotTheRecordedFile, check_recorded, is_local_fs, json_lines, json_or_none, read_json,
                                digest_of, remove_temp_files, same_digest, url_fs)
from elmo_pipeline.fsio.fs import MAX_JSON_BYTES
from elmo_pipeline.output.lease import RetryLater
from elmo_pipeline.output import manifest as manifests
from elmo_pipeline.output.names import COUNTS, DEAD, DEAD_LETTERS, DOCS, METRICS, PLAN, RECORDS, REPORT, STAGING, STATS, is_final_name
from elmo_pipeline.output.report import build_report
from elmo_pipeline.output.sink import Sink, placed_there, success_marker
from elmo_pipeline.output.stats import STAGES, is_stats, merge_stats

logger = logging.getLogger("elmo-pipeline.finalize")
DEAD_LETTERS_PER_FILE = 100_000


class Incomplete(RuntimeError):
    """The staging folder does not (yet) hold every sentence: another round must embed what is missing."""


@dataclass
class Staged:
    """What plan_from_staging() found: the shards to publish, dead letters (no duplicates), summed counts;
    for the run report, the shards' commit records and the staged run statistics (output/stats.py)."""
    shards: list[ShardInfo]
    dead: list[DeadLetter]
    counts: dict
    records: list[dict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    docs: list[str] = field(default_factory=list)      # staged documents' content hashes (--iceberg-mode upsert)


class Selected(NamedTuple):
    """select_records' answer."""
    records: list[dict]             # the commit records kept
    paths: list[str]                # their files
    ids: set[str]                   # their sentence ids
    left_out: set[str]              # ids only in records left out (files gone, or overlapping a kept one)
    damaged: list[str]              # record files that are no whole record


def read_staged(fs, paths: list[str]) -> dict[str, bytes]:
    """{path: bytes} of staged files read back (commit records, counts, dead letters, statistics): local ones only
    when regular files of at most MAX_JSON_BYTES (a FIFO never blocks, a huge file is never read); the others left
    out, as a damaged file is."""
    if is_local_fs(fs):
        paths = [p for p in paths if _small_regular(p)]
    return fs.cat(paths, on_error="omit") if paths else {}      # concurrent GETs on object stores


def _small_regular(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= MAX_JSON_BYTES


def select_records(fs, st: str, present: set[str], whole: Callable[[dict], bool] | None = None) -> Selected:
    """The commit records of <st>/committed/ (Selected): a pairwise-disjoint set of records whose files are all
    present (and, with `whole`, for which whole(record) holds), first come first kept in name order (a retried
    bundle's record overlapping one already kept is left out); a record file that is no whole record
    (formats.layout.checked_record) or names another run key than the folder's (earlier versions name none) is
    left out too, its path listed."""
    rec_dir, key = posixpath.join(st, RECORDS), posixpath.basename(st.rstrip("/"))
    names = sorted(p for p in present if p.startswith(rec_dir + "/") and p.endswith(".json"))
    contents = read_staged(fs, names)
    records, paths, done, named, damaged = [], [], set(), set(), []
    for path in names:
        got = layout.checked_record(contents[path]) if path in contents else None
        if got is not None and got[0].get("run", key) != key:       # copied from another run's staging folder
            logger.warning("%s: a commit record of another run (run key %s), not this one's (%s)", path,
                           repr(got[0]["run"])[:80], key)
            got = None
        if got is None:
            damaged.append(path)
            continue
        rec, ids = got
        named.update(ids)
        files = [posixpath.join(st, f) for f in rec.get("files", {}).values()]
        if not all(f in present for f in files) or done.intersection(ids) or (whole and not whole(rec)):
            continue
        done.update(ids)
        records.append(rec)
        paths.append(path)
    return Selected(records, paths, done, named - done, damaged)


def plan_from_staging(staging: str, files: list[str], storage_options: dict | None = None) -> Staged:
    """Read and check what the run staged (see the module docstring). Incomplete when a sentence some record
    names is in no selected record, or an input file has no counts."""
    fs, st = url_fs(staging, storage_options)
    fs.invalidate_cache()
    listed = fs.find(st, detail=True)       # the same listing, with each file's size
    present = set(listed)
    records, _, covered, left_out, damaged = select_records(fs, st, present,
                                                            lambda rec: _sizes_as_recorded(listed, st, rec))
    if damaged:                 # its sentences are unknown: the next round drops it and embeds them again
        raise Incomplete(f"{damaged[0]}: not a whole commit record ({len(damaged)} such)")
    if left_out:
        raise Incomplete(f"{len(left_out)} sentence(s) are only in shards whose files are gone, changed or that "
                         "overlap others")
    counts_dir = posixpath.join(st, COUNTS) + "/"
    count_files = sorted(p for p in present if p.startswith(counts_dir) and p.endswith(".json"))
    parts: dict[str, dict] = {}         # url -> {part: counts}, a file read whole being its part 0 of 1
    counted_files = read_staged(fs, count_files)
    for path in count_files:
        c = _staged_json(path, counted_files.get(path, b""), _is_counts)
        k, n = c.get("part", (0, 1))
        parts.setdefault(c["url"], {})[k] = (n, c)
    counted = {u for u, got in parts.items() if all(n == len(got) for n, _ in got.values())}
    if set(files) - counted:
        raise Incomplete(f"{len(set(files) - counted)} input file(s) have no record counts (of every part)")
    counts = {k: sum(c[k] for got in parts.values() for _, c in got.values()) for k in ("input_records", "blank_records")}
    dead_dir = posixpath.join(st, DEAD) + "/"
    dead_files = sorted(p for p in present if p.startswith(dead_dir) and p.endswith(".jsonl"))
    dead_data = read_staged(fs, dead_files)
    if set(dead_files) - set(dead_data):
        raise Incomplete(f"{sorted(set(dead_files) - set(dead_data))[0]}: a damaged staged file")
    letters = {_dead_letter(path, line) for path, data in dead_data.items() for line in json_lines(data)}
    # a sentence both written and dead-lettered (an embedding failure that a retry did not repeat): written wins
    letters = sorted((d for d in letters if d.level != "sentence" or d.id not in covered),
                     key=lambda d: (d.id, d.level, d.reason, d.excerpt))
    stats_dir = posixpath.join(st, STATS) + "/"
    stats_files = sorted(p for p in present if p.startswith(stats_dir) and p.endswith(".json"))
    stats_data = read_staged(fs, stats_files)
    stats = [d for d in (_report_stats(p, stats_data.get(p, b"")) for p in stats_files) if d]
    docs_dir = posixpath.join(st, DOCS) + "/"
    docs = sorted(p for p in present if p.startswith(docs_dir) and p.endswith(".jsonl"))
    return Staged([ShardInfo.from_record(r, st) for r in records], letters, counts, records, stats, docs)


def _sizes_as_recorded(listed: dict, st: str, rec: dict) -> bool:
    """Whether each of a commit record's staged files has the size its worker recorded (`listed`: the staging folder's
    listing with sizes, so no request more): a file replaced since (another shard's, a foreign one) is never
    published; False with a warning, and the next round (output/state.py: resume) checks its SHA-256, drops it and
    embeds its sentences again. A same-size change is found there only when a round resumes, and by readers'
    validate(). A record without digests (an earlier version's) is taken as it is."""
    digests = rec.get("digests") if isinstance(rec.get("digests"), dict) else {}
    for fmt, name in rec.get("files", {}).items():
        record, path = digests.get(fmt), posixpath.join(st, name)
        size = (listed.get(path) or {}).get("size")
        if manifests.is_file_record(record) and size != record["bytes"]:
            logger.warning("%s: %s bytes, %d recorded by its worker (changed since it was staged); its shard is not "
                           "published", path, size, record["bytes"])
            return False
    return True


def _staged_json(path: str, data: bytes, whole) -> dict:
    """A staged JSON file's object when whole(it); else Incomplete: the next round (output/state.py's
    prepare_output) keeps only commit records and statistics, so it writes counts and dead letters anew."""
    d = json_or_none(data)
    if not whole(d):
        raise Incomplete(f"{path}: a damaged staged file")
    return d


def _report_stats(path: str, data: bytes) -> dict | None:
    """A staged statistics file (output/stats.py: the run report's figures only), or None with a warning when it
    is damaged (the next round keeps statistics files, so one never comes back whole)."""
    d = json_or_none(data)
    if not is_stats(d):
        logger.warning("%s: a damaged statistics file, left out of the run report", path)
        return None
    return d


def _is_counts(c) -> bool:
    part = c.get("part", (0, 1)) if isinstance(c, dict) else None
    return (isinstance(c, dict) and isinstance(c.get("url"), str)
            and all(type(c.get(k)) is int for k in ("input_records", "blank_records"))
            and isinstance(part, (list, tuple)) and len(part) == 2 and all(type(x) is int for x in part)
            and 0 <= part[0] < part[1])


def _dead_letter(path: str, line: str) -> DeadLetter:
    d = _staged_json(path, line.encode(), lambda d: isinstance(d, dict) and all(
        isinstance(d.get(k), str) for k in ("id", "reason", "excerpt", "level")))
    return DeadLetter(d["id"], d["reason"], d["excerpt"], d["level"])


def finalize(output: str, staging: str, staged: Staged, manifest: dict, storage_options: dict | None = None,
             register: Callable[[dict, Callable[[], None] | None], None] | None = None, run_seconds: float | None = None,
             fence: Callable[[], None] | None = None, upsert=None) -> dict:
    """Publish `staged`: dead letters as files of at most DEAD_LETTERS_PER_FILE (sorted by id), the run
    report (report.html; `run_seconds`: the run's wall time so far, for it) and metrics.prom, then the plan (finalize.json:
    every move and `manifest` completed with counts and the shard list), then complete_finalize() (with
    `register` and `fence`). `upsert` (formats.iceberg.upsert.Upsert): the documents' state file too, and its
    counts. Returns the manifest."""
    sink, st = Sink.at(staging, storage_options, fence)
    dead = []
    for n, i in enumerate(range(0, len(staged.dead), DEAD_LETTERS_PER_FILE)):
        part = staged.dead[i: i + DEAD_LETTERS_PER_FILE]
        path = posixpath.join(st, f"dead_letters-{n:05d}.jsonl")
        sink.put(path, "".join(d.to_json() + "\n" for d in part).encode("utf-8"))
        dead.append(ShardInfo({DEAD_LETTERS: path}, len(part), 0, part[0].id, extra=layout.count_dead_letters(part)))
    m = json.loads(json.dumps(manifest, default=str))
    counts = m.setdefault("counts", {})
    counts.update(manifests.record_counts(staged.counts, dead))
    counts["documents"] = counts["input_records"] - counts["blank_records"] - counts["record_dead_letters"]
    m, moves = manifests.complete(m, staged.shards, dead)
    if upsert is not None:
        moves.append(stage_upsert_state(sink, st, upsert, staged, m))
    try:            # an extra: a report that cannot be built must not cost the run its output
        page = build_report(m, staged.records, staged.stats, run_seconds)
    except Exception:  # noqa: BLE001
        logger.exception("could not build the run report; the output is complete without it")
    else:
        sink.put(posixpath.join(st, REPORT), page.encode("utf-8"))
        moves.append([posixpath.join(st, REPORT), REPORT])
        m["report"] = REPORT
    m["metrics"] = METRICS      # the manifest's counts, so written from it once it is complete
    seconds = merge_stats(staged.stats)["seconds"]
    text = metrics_text(m, output, {k: seconds.get(k, 0.0) for k in STAGES}, run_seconds,
                        time.time())
    sink.put(posixpath.join(st, METRICS), text.encode("utf-8"))
    moves.append([posixpath.join(st, METRICS), METRICS])
    m["files"] = manifests.file_records(moves, staged.shards, sink.written)
    relative = [[_inside_staging(st, src), rel] for src, rel in moves]        # the folder may move: read_plan
    sink.put(posixpath.join(st, PLAN), json.dumps({"moves": relative, RELATIVE: True, "manifest": m}).encode())
    complete_finalize(output, staging, storage_options, register, fence)
    return m


def stage_upsert_state(sink: Sink, st: str, upsert, staged: Staged, m: dict) -> list[str]:
    """--iceberg-mode upsert: the table's documents after this run (`upsert`: formats.iceberg.upsert.Upsert, from
    the staged documents' hashes and the run's dead letters) staged as DOC_HASHES, its counts and entry in the
    manifest `m`. Returns the move that publishes it."""
    docs = sink.fs.cat(staged.docs).values() if staged.docs else ()
    state = upsert.state_after(docs, staged.dead)
    path = posixpath.join(st, DOC_HASHES)
    sink.put(path, upsert.state_bytes(state))
    manifests.with_upsert(m, upsert.change_counts(state), upsert.section())
    return [path, DOC_HASHES]


RELATIVE = "sources_relative"      # a plan's key: its moves name their staged files relative to the staging folder


def read_plan(fs, st: str) -> dict | None:
    """The finalize plan in staging folder `st`, each move's staged file as a path under `st` (_staged_path); None
    when there is none, or when it is no whole plan (damaged: not a JSON object, a move that is not [a file in `st`,
    a final name (output/names.is_final_name)], a manifest of another kind or without its file records), with a
    warning: the run then goes on as if its Finalize had not started (prepare_output
    removes the file with the staging folder's other leftovers)."""
    path = posixpath.join(st, PLAN)
    try:
        plan = read_json(fs, path)
    except FileNotFoundError:
        return None
    moves = plan.get("moves") if isinstance(plan, dict) else None
    pairs = isinstance(moves, list) and all(isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)
                                            for m in moves)
    if pairs:
        moves = [[_staged_path(st, src, plan.get(RELATIVE) is True), rel] for src, rel in moves]
    if not (pairs and layout.is_manifest(plan.get("manifest")) and _records_kept(plan["manifest"])
            and all(src is not None and is_final_name(rel) for src, rel in moves)):
        logger.warning("%s: not a whole finalize plan; the run goes on without it", path)
        return None
    return {**plan, "moves": moves}


def _records_kept(manifest: dict) -> bool:
    """Whether a plan's manifest has its file records, or is of a version that wrote none (recorded_files)."""
    try:
        layout.recorded_files(manifest)
    except ValueError:
        return False
    return True


def _inside_staging(st: str, path: str) -> str:
    """A staged file's name relative to the staging folder `st` (ValueError for a path outside it: a bug)."""
    if not path.startswith(st + "/"):
        raise ValueError(f"finalize: {path} is not in the staging folder {st}")
    return path[len(st) + 1:]


def _staged_path(st: str, src: str, relative: bool) -> str | None:
    """A plan's staged file as a path under `st`: `relative` (the plan says RELATIVE, as finalize writes it: the
    output folder may have moved since), a name inside `st`; else (plans of earlier versions) a path under `st`.
    None for anything else (outside `st`, '..', empty)."""
    if relative:
        if not src or src.startswith("/") or "://" in src:
            return None
        src = posixpath.join(st, src)
    elif not src.startswith(st + "/"):
        return None
    name = src[len(st) + 1:]
    return src if name and ".." not in name.split("/") else None


def plan_consistent(fs, root: str, st: str, plan: dict) -> bool:
    """True when every move of `plan` still has its file, under the staged or the final name, and each is the file
    the plan's manifest records (size and SHA-256: fsio.check_recorded; a file without a record: present)."""
    staged = set(fs.find(st)) if fs.exists(st) else set()
    records = plan["manifest"].get("files") or {}
    for src, rel in plan["moves"]:
        path = src if src in staged else posixpath.join(root, rel)
        if src not in staged and not fs.exists(path):
            return False
        if not as_recorded(fs, path, records.get(rel)):
            return False
    return True


def _manifest_ours(fs, root: str, manifest: dict) -> bool:
    """Whether the output's manifest.json is there and this run's (its run key: one an earlier try of this finalize
    wrote, maybe registered since)."""
    path = posixpath.join(root, MANIFEST)
    if not fs.exists(path):
        return False
    try:
        there = layout.read_manifest(fs, root) if fs.isfile(path) else None
    except (OSError, ValueError):
        there = None
    run = (there or {}).get("run")
    return isinstance(run, dict) and run.get("key") == manifest.get("run", {}).get("key")


def as_recorded(fs, path: str, record, then: str = "the interrupted finalize is rolled back") -> bool:
    """Whether `path` is the file `record` describes (no whole record: nothing to check); False with a warning
    saying what happens `then`."""
    if not manifests.is_file_record(record):
        return True
    try:
        check_recorded(fs, path, record)
    except NotTheRecordedFile as e:
        logger.warning("%s; %s", e, then)
        return False
    return True


def moved_there(fs, src: str, dst: str, record, staged: bool) -> bool:
    """Whether the file at `dst` is the one the plan's move src -> dst put there (`record`: the plan's
    {"bytes", "sha256"} of it, or None; `staged`: src is still in the staging folder): a regular file, the recorded
    one (with src still staged: the same file, a local hard link made and its unlink not, or a whole copy of it, an
    object store's copy made and its delete not). A file placed there by anyone else (a FIFO, a folder, other bytes,
    a changed copy) is not: no command deletes or moves it."""
    import stat
    try:
        if is_local_fs(fs):
            st = os.lstat(dst)
            if not stat.S_ISREG(st.st_mode):
                return False
            if staged and os.path.samestat(st, os.stat(src)):
                return True
            size = st.st_size
        else:
            info = fs.info(dst)
            if info.get("type") != "file":
                return False
            size = info.get("size")
        if not manifests.is_file_record(record):
            if not staged:
                return True             # an earlier version's plan records no file: taken by its name
            record = digest_of(fs, src)
        return size == record["bytes"] and same_digest(fs, dst, record)
    except FileNotFoundError:
        return False


def roll_back(sink: Sink, root: str, st: str, plan: dict) -> None:
    """Undo a plan that cannot be completed: files already moved go back to their staged names (a copy left
    at the final name by a move cut short is removed), the plan and manifest.json (this run's) are removed
    (their shards' commit records then decide what is kept). A file at a final name that no move put there
    stays."""
    fs = sink.fs
    staged = set(fs.find(st))
    records = plan["manifest"].get("files") or {}
    for src, rel in plan["moves"]:
        dst = posixpath.join(root, rel)
        if fs.exists(dst) and moved_there(fs, src, dst, records.get(rel), src in staged):
            if src in staged:
                sink.remove(dst)
            else:
                sink.move(dst, src)
    if _manifest_ours(fs, root, plan["manifest"]):
        sink.remove(posixpath.join(root, MANIFEST))
    if fs.exists(posixpath.join(st, PLAN)):
        sink.remove(posixpath.join(st, PLAN))


def complete_finalize(output: str, staging: str, storage_options: dict | None = None,
                      register: Callable[[dict, Callable[[], None] | None], None] | None = None,
                      fence: Callable[[], None] | None = None) -> dict | None:
    """Carry out (again) the finalize plan in `staging`: every move not yet done, manifest.json, removal of
    the staging folder, then register(manifest) when given (every file is in place; it must be idempotent:
    a run killed after it calls it again), _SUCCESS last; each of them fenced (LeaseLost when the lease is
    lost). Without a plan (already removed), only the last steps. Returns the manifest written (or found),
    or None."""
    sink, root = Sink.at(output, storage_options, fence)
    fs = sink.fs
    _, st = url_fs(staging, storage_options)
    staged = set(fs.find(st)) if fs.exists(st) else set()     # one listing instead of a request per file
    plan = read_plan(fs, st) if posixpath.join(st, PLAN) in staged else None
    if plan is not None:
        records = plan["manifest"].get("files") or {}
        for src, rel in plan["moves"]:
            dst = posixpath.join(root, rel)
            if src in staged:                # not moved yet (or linked or copied but not unlinked or deleted)
                if fs.exists(dst) and moved_there(fs, src, dst, records.get(rel), True):
                    sink.remove(src)         # the move's unlink or delete is left
                else:
                    sink.move(src, dst)      # never over a file placed there while the run went on
            elif not fs.exists(dst):
                raise RetryLater(f"finalize: staged file {src} is gone and {dst} was never written; "
                                        "rerun the same command: it re-embeds that shard")
        there = fs.exists(posixpath.join(root, MANIFEST))
        if there and not _manifest_ours(fs, root, plan["manifest"]):
            raise placed_there(posixpath.join(root, MANIFEST))      # never replaced
        manifests.write(sink, root, plan["manifest"], create=not there)     # nor one placed since
    if fs.exists(st):
        sink.remove(st, recursive=True)
    staging_parent = posixpath.join(root, STAGING)
    if fs.exists(staging_parent) and not fs.ls(staging_parent):
        sink.remove(staging_parent, recursive=True)
    manifest = plan["manifest"] if plan else layout.read_manifest(fs, root)
    if register is not None and manifest is not None:
        sink.fence()
        register(manifest, fence)
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))
    marker = success_marker(fs, root)
    if marker is False:
        raise placed_there(posixpath.join(root, SUCCESS))        # never replaced
    if marker is None:                      # created only: one placed there after this look is no run's either
        sink.put(posixpath.join(root, SUCCESS), b"", create=True)
    else:
        sink.fence()                        # nothing left to write: a run that lost its lease still ends here (75)
    return manifest


