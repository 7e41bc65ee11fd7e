"""Resuming an interrupted run: the run key, the state of an output folder, the shards already committed.

No Beam import. A run's staging folder is <out>/_staging/<run key>/, where the run key is a hash of
everything that decides the output's content (run_ingredients: the expanded inputs with their sizes and
mtimes/etags, the model's weights sha256 and options, and every content option). Rerunning the same
command after a crash finds the same folder:

  committed/<shard>.json   commit records of the shards already written (files, counts, sentence ids)
  finalize.json            present once Finalize has started: the moves and the manifest
  run.json                 the key's ingredients (to explain a mismatch), and the kernel path the run planned
  dead/, counts/           dead letters and per-file counts: not resumed (every run reads and tokenizes all)
  stats/                   run statistics for the report: kept (its timings count every attempt)

prepare_output() decides what a new run does with the folder it is given; see its docstring. It first
checks that the folder holds nothing in the way that the pipeline did not write (check_ownership).
"""
from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Callable

from elmo_pipeline.formats.layout import (RECORD_KEYS_WITH_DIGESTS, ShardInfo, checked_record, read_manifest,
                                           recorded_files)
from elmo_pipeline.fsio import NotTheRecordedFile, check_recorded, read_json, url_fs
from elmo_pipeline.output.finalize import as_recorded, plan_consistent, read_plan, read_staged, roll_back, select_records
from elmo_pipeline.output.manifest import is_file_record
from elmo_pipeline.output.names import PLAN, RUN_FILE, SHARD_FILES, STAGING, STATS, is_final_name
from elmo_pipeline.output.ownership import check_no_links, check_ownership, clear_final, plan_names
from elmo_pipeline.output.sink import Sink, success_marker

logger = logging.getLogger("elmo-pipeline.resume")

KEY_VERSION = 1
# Options left out of the run key: they change neither which sentences are written nor their vectors
# (beyond float32 round-off): layout (shard sizes, row groups), speed (threads, device), the output itself,
# the sort buffer (batches only; not in stateful mode, where batches decide the vectors), and where the
# finished output is registered (--iceberg-*: the same files, added to a table), where vectors are copied from
# (--reuse: the same vectors, by key: docs/reuse.md), and --id-root (the ids it
# gives are in the key when they differ from the default ones: pipeline/plan.py plan()). Every other
# option of ElmoOptions is in the key, new ones included: a flag nobody thought about refuses a resume
# rather than mixing two outputs. The batch budget stays in (it caps long-sentence windows). The model
# files are in through their identity (weights sha256, parsed options), the inputs through their
# fingerprints (input_fingerprints), not their names.
NOT_CONTENT = {"output", "overwrite", "progress", "torch_threads", "device", "shard_sentences", "shard_bytes",
               "row_group_bytes", "vector_compression", "sort_buffer", "input", "options_file", "weight_file", "model", "s3_max_attempts",
               "lease_stale_seconds", "tokenizer_process", "embed_threads", "iceberg_table", "iceberg_catalog", "iceberg_warehouse",
               "id_root", "dedupe", "reuse", "reuse_table", "reuse_across_kernels", "iceberg_mode", "delete_missing"}   # upsert's: in the key when given (plan.py)


def input_fingerprints(files: list[str], storage_options: dict | None = None, fresh: bool = False) -> list[list]:
    """[url, size, version] per input file; version is the object's ETag/generation or the file's mtime. `fresh`: the
    store asked now (an object store's filesystem otherwise answers from the listing it cached while planning)."""
    out = []
    for url in files:
        fs, path = url_fs(url, storage_options)
        if fresh:
            fs.invalidate_cache(path)
        info = fs.info(path)
        version = next((info[k] for k in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified",
                                          "last_modified", "created") if info.get(k) is not None), None)
        out.append([url, info.get("size"), str(version)])
    return out


def run_ingredients(options: dict, inputs: list[list], model: dict) -> dict:
    """What the run key hashes: input fingerprints, model identity (weights sha256, options), content options."""
    skip = NOT_CONTENT - ({"sort_buffer"} if options.get("state") == "stateful" else set())
    opts = {k: v for k, v in sorted(options.items()) if k not in skip}
    return {"version": KEY_VERSION, "inputs": inputs, "options": opts,
            "model": {"weights_sha256": model.get("weights_sha256"), "options": model.get("options")}}


def run_key(ingredients: dict) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True, default=str).encode()).hexdigest()[:20]


def describe_difference(old: dict | None, new: dict) -> str:
    """A short human account of how two runs' ingredients differ."""
    if not isinstance(old, dict) or not old:
        return "it was started by an older version or a different command (no readable run.json)"
    diffs = []
    then = old.get("options") if isinstance(old.get("options"), dict) else {}
    for k in sorted(set(then) | set(new["options"]), key=str):
        a, b = then.get(k), new["options"].get(k)
        if a != b:
            diffs.append(f"--{str(k).replace('_', '-')} {a!r} then, {b!r} now")
    if old.get("model") != new["model"]:
        diffs.append("the model (weights or options) changed")
    inputs = old.get("inputs") if isinstance(old.get("inputs"), list) else []
    oi = {str(i[0]): i[1:] for i in inputs if isinstance(i, list) and i}
    ni = {i[0]: i[1:] for i in new["inputs"]}
    if set(oi) != set(ni):
        diffs.append(f"the input files differ ({len(set(oi) ^ set(ni))} added or removed)")
    else:
        changed = [u for u in ni if oi[u] != ni[u]]
        if changed:
            diffs.append(f"{len(changed)} input file(s) changed size or modification time, e.g. {changed[0]}")
    return "; ".join(diffs) or "unknown difference"


@dataclass
class OutputState:
    """What prepare_output found: `action` is 'fresh', 'resume', 'finalize' (only the finalize is left) or
    'complete' (a finished run of this key)."""
    action: str
    staging: str
    key: str
    records: list[dict] = field(default_factory=list)      # commit records kept (pairwise disjoint)
    record_paths: list[str] = field(default_factory=list)  # their paths (SkipCommitted loads their ids)

    @property
    def shards(self) -> list[ShardInfo]:
        root = self.staging.split("://", 1)[-1]
        return [ShardInfo.from_record(r, root) for r in self.records]

    @property
    def sentences(self) -> int:
        return sum(r["sentences"] for r in self.records)


def _read_json(fs, path):
    """The JSON value of the file at path; None when there is none or it is damaged (not JSON)."""
    try:
        return read_json(fs, path)
    except FileNotFoundError:
        return None


def _dirs(fs, path) -> list[str]:
    return [posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(path, detail=True)
            if e["type"] == "directory"] if fs.exists(path) else []


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] + "://" if "://" in url else ""


def is_complete(output: str, key: str, storage_options: dict | None = None) -> bool:
    """True when `output` holds a finished run (_SUCCESS) whose manifest has run key `key`. Reads only."""
    fs, root = url_fs(output, storage_options)
    fs.invalidate_cache()
    if not success_marker(fs, root):
        return False
    return ((read_manifest(fs, root) or {}).get("run") or {}).get("key") == key


def finalize_started(output: str, key: str, storage_options: dict | None = None) -> bool:
    """True when `output` holds a finished run of `key`, or one whose Finalize got to its plan or its manifest
    (a rerun only finishes that Finalize, unless a file is gone). Reads only."""
    fs, root = url_fs(output, storage_options)
    fs.invalidate_cache()
    if ((read_manifest(fs, root) or {}).get("run") or {}).get("key") == key:
        return True
    return fs.exists(posixpath.join(root, STAGING, key, PLAN))


def keeps_final_files(output: str, key: str, storage_options: dict | None = None) -> bool:
    """Whether a run of `key` without --overwrite leaves the final files `output` holds where they are: it holds
    that run finished, or only its Finalize is left with every file it lists there as recorded (prepare_output's
    'complete' and 'finalize'); any other rerun starts over or rolls a plan back, moving or removing them. Reads
    only."""
    fs, root = url_fs(output, storage_options)
    fs.invalidate_cache()
    manifest = read_manifest(fs, root)
    mine = ((manifest or {}).get("run") or {}).get("key") == key
    if success_marker(fs, root):
        return mine
    st = posixpath.join(root, STAGING, key)
    plan = read_plan(fs, st)
    if plan is None:
        return mine and _listed_files_present(fs, root, manifest, "a rerun would start over")
    return (manifest is None or mine) and plan_consistent(fs, root, st, plan)


def _listed_files_present(fs, root: str, manifest: dict, then: str = "starting over") -> bool:
    """Whether the shard and dead-letter files a manifest lists are there, each named as Finalize names them
    (output/names.py is_final_name: inside the output) and the file it records, every one recorded where the
    manifest records files. False, with a warning (saying what happens `then`), for anything else (an edited or
    damaged manifest)."""
    problem = listed_files_problem(fs, root, manifest)
    if problem is not None:
        logger.warning("%s: %s; %s", root, problem, then)
    return problem is None


def listed_files_problem(fs, root: str, manifest: dict) -> str | None:
    """What keeps a manifest's listed shard and dead-letter files from being the ones it records (_listed_files_present),
    in one phrase naming the first such file; None when they all are."""
    rels = _listed(manifest)
    try:
        records = recorded_files(manifest)
    except ValueError as e:
        return str(e)
    if rels is None or not all(is_final_name(r) for r in rels) or \
            records is not None and not all(r in records for r in rels):
        return ("its manifest lists files that are not this pipeline's output, or that it records no size and "
                "SHA-256 for")
    for r in rels:
        path = posixpath.join(root, r)
        if not fs.exists(path):
            return f"{path}: gone"
        record = (records or {}).get(r)
        if is_file_record(record):
            try:
                check_recorded(fs, path, record)
            except NotTheRecordedFile as e:
                return str(e)
    return None


def check_unchanged(output: str, manifest: dict, storage_options: dict | None = None, what: str = "") -> None:
    """FileExistsError (exit 2), one line naming the file, unless the finished `output` still holds every shard and
    dead-letter file its `manifest` lists as recorded (size and SHA-256, streamed): a file changed, swapped or gone
    since the run finished is no longer the pipeline's output, and nothing is done `what` (e.g. registering it)."""
    fs, root = url_fs(output, storage_options)
    fs.invalidate_cache()
    problem = listed_files_problem(fs, root, manifest)
    if problem is not None:
        raise FileExistsError(f"{output} no longer holds the finished run its manifest lists ({problem}){what}: "
                              "rerun with --overwrite to write it again, or write to a new --output")


def _listed(manifest: dict) -> list | None:
    """The shard and dead-letter file names a manifest lists, as they are; None when its lists are damaged."""
    shards, dead = manifest.get("shards"), manifest.get("dead_letter_files", [])
    if not (isinstance(shards, list) and isinstance(dead, list) and all(isinstance(e, dict) for e in shards + dead)):
        return None
    return [e[f] for e in shards for f in SHARD_FILES if f in e] + [e.get("path") for e in dead]


def prepare_output(output: str, key: str, ingredients: dict, overwrite: bool, storage_options: dict | None = None,
                   resumable: bool = True, kernel_path: dict | None = None, writes_state: bool = False,
                   fence: Callable[[], None] | None = None) -> OutputState:
    """Decide what a run with run key `key` does with `output`, and make the folder ready for it. The caller
    holds the output's lease, and `fence` (its check_held) runs before every removal and write here: a run paused
    past the stale age after taking the lease (another run took it over and may have finished since) removes
    nothing. Nothing is removed before every refusal has been decided; only what the
    pipeline wrote is ever removed (check_no_links and check_ownership first, then output/finalize.clear_final).

    - _SUCCESS of this key: 'complete' (with `overwrite`: cleared, fresh). Of another key: refused unless
      `overwrite`, which clears it.
    - manifest.json without _SUCCESS: a finalize that got past writing the manifest; with the same key
      only the finalize is left ('finalize'), unless a file it lists is gone (then everything is cleared
      and the run starts fresh); another key is refused unless `overwrite`.
    - an unfinished run of another key in _staging/: refused (naming the difference) unless `overwrite`,
      which deletes it (and the files its finalize had moved).
    - _staging/<key>/finalize.json: 'finalize' when every file of the plan is still there (staged or
      moved); otherwise the plan is rolled back (output/finalize.roll_back) and the run resumes.
    - commit records: 'resume' with a pairwise-disjoint set of those whose files are all present; staged
      files no kept record names (partial shards, dropped records, dead letters, counts) are deleted.
      `resumable` False (--state stateful: vectors depend on batch history) keeps nothing.
    - otherwise 'fresh'. Outside 'finalize', leftover final-name files of the pipeline are removed first.
    """
    sink, root = Sink.at(output, storage_options, fence)
    fs = sink.fs
    found = survey(output, key, ingredients, overwrite, storage_options, writes_state, fs, root)
    parent, st = found.parent, found.staging
    manifest, mine, finished, others, plan = found.manifest, found.mine, found.finished, found.others, found.plan
    state = OutputState("fresh", _scheme(output) + st, key)
    if found.action in ("complete", "finalize"):
        state.action = found.action
        return state
    if finished:                    # --overwrite: start over
        clear_final(sink, root)
        if fs.exists(parent):
            sink.remove(parent, recursive=True)
        manifest, others, plan = None, [], None
    if manifest is not None and mine and plan is None:
        logger.warning("%s: manifest.json lists files that are gone and the staged shards were removed: "
                       "starting over", output)
        clear_final(sink, root)
    if others or (manifest is not None and not mine):     # --overwrite: another command's files go first
        clear_final(sink, root, keep=plan_names(plan) if plan else set())
        for d in others:
            sink.remove(posixpath.join(parent, d), recursive=True)
    if plan is not None:
        if plan_consistent(fs, root, st, plan):
            state.action = "finalize"
            return state
        logger.warning("%s: the interrupted finalize lost files; rolling it back and re-embedding their shards",
                       output)
        roll_back(sink, root, st, plan)
    clear_final(sink, root)
    if fs.exists(st):
        if resumable and not _other_kernel_path(fs, st, kernel_path):
            _keep_disjoint_records(sink, st, state)
        else:
            sink.remove(st, recursive=True)
        state.action = "resume" if state.records else "fresh"
    if not fs.exists(posixpath.join(st, RUN_FILE)):
        sink.put(posixpath.join(st, RUN_FILE), json.dumps({**ingredients, "kernel_path": kernel_path},
                                                          default=str).encode())
    return state


@dataclass
class Survey:
    """What survey() found in an output folder (paths within its filesystem): `action` 'complete' (a finished run
    of this key, without --overwrite), 'finalize' (only the finalize of this key is left and no plan of it was
    written) or '' (prepare_output decides, changing the folder)."""
    action: str
    parent: str                     # <root>/_staging
    staging: str                    # <root>/_staging/<key>
    manifest: dict | None
    mine: bool                      # the manifest is this key's
    finished: bool                  # _SUCCESS is there
    others: list[str]               # other keys' staging folders
    plan: dict | None               # this key's finalize plan


def survey(output: str, key: str, ingredients: dict, overwrite: bool, storage_options: dict | None = None,
           writes_state: bool = False, fs=None, root: str | None = None) -> Survey:
    """What a run of `key` finds in `output` once it holds the lease, and the refusals it meets there before it
    changes anything (FileExistsError: check_no_links, check_ownership, _refuse_another_command). Reads only:
    prepare_output() acts on it, and --dry-run (pipeline/dry_run.py) reports it, the same refusals in the same
    words."""
    if fs is None:
        fs, root = url_fs(output, storage_options)
    fs.invalidate_cache()
    check_no_links(output, fs, root)      # first: a link is named as one, not as the files it leads to
    check_ownership(output, fs, root, overwrite, writes_state)
    parent = posixpath.join(root, STAGING)
    st = posixpath.join(parent, key)
    manifest = read_manifest(fs, root)
    mine = ((manifest or {}).get("run") or {}).get("key") == key
    finished = bool(success_marker(fs, root))
    others = [d for d in _dirs(fs, parent) if d != key]
    plan = read_plan(fs, st)
    found = Survey("", parent, st, manifest, mine, finished, others, plan)
    if finished and mine and not overwrite:
        found.action = "complete"
    elif not finished and mine and plan is None and _listed_files_present(fs, root, manifest):
        found.action = "finalize"
    else:
        _refuse_another_command(output, fs, parent, manifest, mine, finished, others, ingredients, overwrite)
    return found


def _refuse_another_command(output: str, fs, parent: str, manifest: dict | None, mine: bool, finished: bool,
                            others: list[str], ingredients: dict, overwrite: bool) -> None:
    """FileExistsError, without --overwrite, when `output` holds a finished run, an interrupted finalize or an
    unfinished run of another command."""
    if overwrite:
        return
    if finished:
        raise FileExistsError(f"{output} holds a finished run of a different command (_SUCCESS); pass "
                              "--overwrite to replace it")
    if manifest is not None and not mine:
        raise FileExistsError(f"{output} holds a manifest.json of a different command whose finalize was "
                              "interrupted; rerun that command to finish it, or pass --overwrite to replace it")
    if others:
        old = _read_json(fs, posixpath.join(parent, others[0], RUN_FILE))
        raise FileExistsError(
            f"{output} holds an unfinished run of a different command ({describe_difference(old, ingredients)}). "
            "Rerun the original command to resume it, or pass --overwrite to discard it and start over")


def _keep_disjoint_records(sink: Sink, st: str, state: OutputState) -> None:
    fs = sink.fs
    present = set(fs.find(st))
    records, paths, _, _, damaged = select_records(fs, st, present, lambda rec: _as_recorded(fs, st, rec))
    for path in damaged:        # removed below with the rest: its shard's sentences are embedded again
        _embedded_again(path)
    stats = posixpath.join(st, STATS) + "/"
    keep = {posixpath.join(st, RUN_FILE), *paths, *(p for p in present if p.startswith(stats) and p.endswith(".json"))}
    for rec in records:
        keep.update(posixpath.join(st, f) for f in rec["files"].values())
    state.records = records
    state.record_paths = [_scheme(state.staging) + p for p in paths]
    gone = sorted(present - keep)    # partial shards, dropped records, dead letters, counts, temp files
    if gone:
        sink.remove(gone)


def _other_kernel_path(fs, st: str, kernel_path: dict | None) -> bool:
    """Whether the interrupted run in `st` computed on another kernel path than this one (its run.json's record
    against `kernel_path`, model/kernels.py); True with a warning: its shards are embedded again, never mixed with
    this run's under one manifest. Unknown on either side (a remote runner, an earlier version): False."""
    old = _read_json(fs, posixpath.join(st, RUN_FILE))
    old = old.get("kernel_path") if isinstance(old, dict) else None
    if not isinstance(old, dict) or kernel_path is None:
        return False
    from elmo_pipeline.model.kernels import kernel_difference
    differ = kernel_difference(old, kernel_path)
    if differ:
        logger.warning("%s: the interrupted run computed on another kernel path (%s, then vs now): its shards are "
                       "embedded again", st, differ)
    return bool(differ)


def _as_recorded(fs, st: str, rec: dict) -> bool:
    """Whether each of a commit record's files is the one its worker recorded (size and SHA-256, streamed:
    fsio.check_recorded); a shard of a version that recorded none is taken as it is, a record of a version that
    records them (RECORD_KEYS_WITH_DIGESTS) without a whole one for each file is not. False, with a warning: its
    sentences are embedded again."""
    digests = rec.get("digests") if isinstance(rec.get("digests"), dict) else {}
    if any(k in rec for k in RECORD_KEYS_WITH_DIGESTS) and not all(is_file_record(digests.get(fmt))
                                                                   for fmt in rec["files"]):
        logger.warning("%s: a commit record without the size and SHA-256 of each of its files, which its version "
                       "always records (edited or damaged); its shard's sentences are embedded again", st)
        return False
    return all(as_recorded(fs, posixpath.join(st, name), digests.get(fmt), "its shard's sentences are embedded again")
               for fmt, name in rec["files"].items())


def _embedded_again(path: str) -> None:
    logger.warning("%s: not a whole commit record; its sentences are embedded again", path)


def load_done_ids(record_paths: list[str], storage_options: dict | None = None) -> set[str]:
    """The sentence ids of the given commit records (all in one staging folder); a record that is no longer whole
    (damaged since prepare_output kept it) adds none, with a warning: its sentences are embedded again, and
    Finalize leaves it out."""
    if not record_paths:
        return set()
    fs, _ = url_fs(record_paths[0], storage_options)
    paths = [url_fs(p, storage_options)[1] for p in record_paths]
    contents = read_staged(fs, paths)         # one dict, fetched concurrently on object stores
    done: set[str] = set()
    for p in paths:
        got = checked_record(contents[p])
        if got is None:
            _embedded_again(p)
        else:
            done.update(got[1])
    return done
