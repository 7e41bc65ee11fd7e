"""Ownership of an output folder: what the pipeline can show it wrote there, what is foreign, and the removal of
only its own files. No Beam import.

The pipeline deletes or replaces only what it can show it wrote (output/names.py): the files its manifest.json
lists with manifest.json and _SUCCESS, the final names a finalize plan under _staging/ moves files to,
everything under _staging/, the lease and its own temporary files. Anything else under a shard folder or at a
name Finalize writes is in the way (a run refuses); other files are left alone. Symbolic links where the
pipeline writes are refused (check_no_links), and every write, move and removal checks again at its moment
(output/sink.py, Sink.check_inside).
"""
from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass

from elmo_pipeline.formats.layout import DOC_HASHES, MANIFEST, SUCCESS, read_manifest, recorded_files
from elmo_pipeline.fsio import is_local_fs, remove_temp_files
from elmo_pipeline.output.finalize import as_recorded, moved_there, read_plan
from elmo_pipeline.output.names import (FINAL_NAMES, METRICS, PROBE, REPORT, SHARD_FOLDERS, STAGING, TOP_FILES,
                                        is_scratch_name, listed_names)
from elmo_pipeline.output.sink import Sink, placed_there, success_marker


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
        plan = read_plan(fs, entry["name"].rstrip("/"))
        if plan is not None:
            plans[entry["name"].rstrip("/")] = plan
    return plans


def plan_names(plan: dict) -> set[str]:
    """The final names (relative to the output folder) that a finalize plan (read_plan's, checked) moves files to."""
    return {m[1] for m in plan["moves"]}


def owned_final_names(fs, root: str) -> set[str]:
    """Names (relative to `root`) of final-name files the pipeline can show it wrote there: what its
    manifest.json lists, with manifest.json and _SUCCESS, and what the finalize plans under _staging/ moved
    there (output/names.py, ownership; a file at a plan's final name that its move did not put there, placed
    while the run went on, is not: finalize.moved_there)."""
    names = set()
    manifest = read_manifest(fs, root)
    if manifest is not None:
        names |= listed_names(manifest) | {MANIFEST} | ({SUCCESS} if success_marker(fs, root) else set())
    for st, plan in staged_plans(fs, root).items():
        staged, records = set(fs.find(st)), plan["manifest"].get("files") or {}
        names |= {rel for src, rel in plan["moves"] if rel in names or moved_there(
            fs, src, posixpath.join(root, rel), records.get(rel), src in staged)}
    return names


def not_as_recorded(fs, root: str, names: list[str]) -> list[str]:
    """Of `names` (relative to `root`), those whose file is not the one the output's manifest records (size, then
    SHA-256: finalize.as_recorded, with a warning): written over by someone else since the pipeline wrote it. A
    name the manifest records nothing for (a plan's, an earlier version's) is taken as it is. Reads each file once."""
    manifest = read_manifest(fs, root)
    try:
        records = (recorded_files(manifest) if manifest is not None else None) or {}
    except ValueError:
        records = {}
    return [n for n in names if n in records and not as_recorded(
        fs, posixpath.join(root, n), records[n], "it is not this pipeline's to remove: nothing is removed")]


def folder_marker(name: str) -> bool:
    """Whether a listed name is an object store's folder marker (an empty object whose key ends in '/', as the S3
    console's "Create folder" and many tools make them): a folder, no file of anyone's."""
    return name.endswith("/")


def files_under(fs, root: str, folders: tuple[str, ...]) -> set[str]:
    """Names (relative to `root`) of the files under the given subfolders of `root` (one listing each)."""
    found = set()
    for sub in folders:
        path = posixpath.join(root, sub)
        if fs.isdir(path):
            found.update(posixpath.relpath(p, root) for p in fs.find(path) if not folder_marker(p))
    return found


def clear_final(sink: Sink, root: str, keep: set[str] = frozenset()) -> None:
    """Remove the final-name files the pipeline wrote under `root` (owned_final_names), but those in `keep`:
    _SUCCESS first, manifest.json last (until then it shows whose the rest are), then shard folders left
    empty and the temporary files of manifest.json and _SUCCESS. Files of unknown origin stay. The sink's fence
    first: a run that lost the output's lease removes none of them (not even another run's temporary files)."""
    sink.fence()
    fs = sink.fs
    owned = owned_final_names(fs, root) - set(keep)
    present = files_under(fs, root, SHARD_FOLDERS) | {n for n in (SUCCESS, MANIFEST, REPORT, METRICS)
                                                       if fs.exists(posixpath.join(root, n))}
    data = sorted((owned & present) - {SUCCESS, MANIFEST})
    changed = not_as_recorded(fs, root, data)
    if changed:             # written over since: nobody's to delete, and Finalize would not move a file over it
        raise placed_there(posixpath.join(root, changed[0]))
    for group in ([SUCCESS], data, [MANIFEST]):
        paths = [posixpath.join(root, n) for n in group if n in owned and n in present]
        if paths:
            sink.remove(paths)
    for sub in SHARD_FOLDERS:
        path = posixpath.join(root, sub)
        if sink.local and fs.isdir(path) and not fs.ls(path):
            fs.rmdir(path)
    remove_temp_files(fs, root, (MANIFEST, SUCCESS))


@dataclass
class Foreign:
    """What an output folder holds that the pipeline cannot show it wrote (names relative to the folder;
    output/names.py, ownership)."""
    in_the_way: list[str]      # under the shard folders or at a name Finalize writes: readers would take them
    #                            for output, or Finalize would replace them
    elsewhere: list[str]       # anything else (a folder ends in '/'): left alone
    ours: bool                 # the folder holds a run of the pipeline (its manifest.json or _staging/)


def foreign_files(fs, root: str, writes_state: bool = False) -> Foreign:
    """Sort the top of `root` and its shard folders into owned and foreign (see Foreign). `writes_state`: the run
    writes DOC_HASHES (an upsert), so a file there that no manifest or plan of the output lists is in its way (a
    user's, or an earlier upsert's state an older snapshot names), else elsewhere. Reads only."""
    owned = owned_final_names(fs, root)
    try:
        top = fs.ls(root, detail=True)
    except FileNotFoundError:
        top = []
    found = Foreign([], [], MANIFEST in owned)
    for entry in top:
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry["type"] != "directory" and folder_marker(entry["name"]):
            continue                # the folder's own marker, or a subfolder's: an empty folder is fine
        if entry["type"] == "directory" and name == STAGING:
            found.ours = True
        elif entry["type"] == "directory" and name in SHARD_FOLDERS:
            found.in_the_way += sorted(n for n in (posixpath.relpath(p, root) for p in fs.find(entry["name"])
                                                   if not folder_marker(p)) if n not in owned)
        elif entry["type"] == "directory" and name in (*TOP_FILES, DOC_HASHES):    # where Finalize puts a file
            found.in_the_way.append(name + "/")
        elif entry["type"] == "directory":
            found.elsewhere.append(name + "/")
        elif name in owned or is_scratch_name(name):
            continue
        elif name in FINAL_NAMES or name == STAGING or (writes_state and name == DOC_HASHES):
            found.in_the_way.append(name)
        else:
            found.elsewhere.append(name)
    found.in_the_way.sort()
    found.elsewhere.sort()
    return found


def _some(names: list[str], n: int = 3) -> str:
    """'a, b, c and 4 more'."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_ownership(output: str, fs, root: str, overwrite: bool, writes_state: bool = False) -> None:
    """FileExistsError (one line naming a few of them) when `output` holds files the pipeline did not write
    in the way of its output (even with --overwrite; `writes_state`: see foreign_files), or, on a folder that
    holds no run of the pipeline, any file or folder at all (unless --overwrite, which writes beside them and
    leaves them alone)."""
    found = foreign_files(fs, root, writes_state)
    if found.in_the_way:
        raise FileExistsError(
            f"{output} holds {len(found.in_the_way)} file(s) this pipeline did not write where its output goes: "
            f"{_some(found.in_the_way)}. It never deletes or replaces them, and readers of its shard folders "
            "would take them for output: move them away or choose another --output")
    if found.elsewhere and not found.ours and not overwrite:
        raise FileExistsError(
            f"{output} is not empty and holds no run of this pipeline: {_some(found.elsewhere)}. Choose an "
            "empty or new --output, or pass --overwrite to write beside them (they are left alone)")


def links_inside(fs, root: str) -> list[str]:
    """The symbolic links (names relative to `root`) at or below the names the pipeline writes in a local output:
    _staging/, the shard folders, the top files. Walked without following a link. Object stores have none."""
    if not is_local_fs(fs):
        return []
    found = []
    for name in (STAGING, *SHARD_FOLDERS, *TOP_FILES):
        path = os.path.join(root, name)
        if os.path.islink(path):
            found.append(name)
            continue
        for folder, dirs, files in os.walk(path):
            found += [os.path.relpath(os.path.join(folder, n), root) for n in dirs + files
                      if os.path.islink(os.path.join(folder, n))]
    return sorted(found)


def check_no_links(output: str, fs, root: str) -> None:
    """FileExistsError naming the symbolic links where the pipeline writes (links_inside): staging, clearing and
    finalizing never follow a link out of the output, so a planted link is refused, not written through."""
    links = links_inside(fs, root)
    if links:
        raise FileExistsError(f"{output} holds {len(links)} symbolic link(s) where this pipeline writes: "
                              f"{_some(links)}. It never follows a link out of its output: remove them")


def probe_writable(output: str, storage_options: dict | None = None) -> None:
    """PermissionError when an object-store --output takes no write: a probe object is written and removed (the
    scratch name is_scratch_name knows)."""
    sink, root = Sink.at(output, storage_options)
    probe = posixpath.join(root, f"{PROBE}{uuid.uuid4().hex}")
    try:
        sink.fs.pipe_file(probe, b"")       # one object, no temporary name: the probe's own name is scratch
        sink.remove(probe)
    except Exception as e:  # noqa: BLE001
        raise PermissionError(f"--output {output} is not writable: {type(e).__name__}: {e}") from None
