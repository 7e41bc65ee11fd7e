"""manifest.json, assembled and written here only. No Beam import.

Its sections come from their owners: the plan gives what a run knows before it starts (planned(): the model,
layers, options, inputs, the run key, and the sections of the features a run uses), the launcher the run's
account (run_section()), Finalize the shards, dead letters, counts, the kernel paths the workers computed on
(with_kernel_paths()) and file records (complete()), the upsert its state's counts and entry (with_upsert()), a
registration the tables the output was registered in (with_table()). write() is the one function that writes the
file: a finalize's moves done (output/finalize.py), or a registration recording its table (output/register.py).
"""
from __future__ import annotations

import json
import posixpath

from elmo_pipeline.formats.layout import ARROW_LAYOUT, MANIFEST, SCHEMA_VERSION, ShardInfo, well_formed_kernel
from elmo_pipeline.fsio import redact
from elmo_pipeline.output.names import DEAD_LETTERS, KEYS, part_name

def planned(model: dict, columns: list[tuple[str, int]], hdf5_layout: str, flags: dict, formats: list[str],
            inputs: list[str], key: str, sections: dict) -> dict:
    """What a run knows before it starts: model identity, layers and widths, content options (`flags`: every
    flag of the run, some of which are also top-level keys), inputs, run key, then `sections` (name: value, in
    the order given)."""
    o = flags
    manifest = {
        "model": model,
        "layers": [c for c, _ in columns], "layer_dims": {c: d for c, d in columns},
        "hdf5_layout": hdf5_layout,
        "dtype": o["dtype"], "compute_dtype": o["compute_dtype"], "state": o["state"], "tokenizer": o["tokenizer"],
        "formats": formats, "parquet_layout": o["parquet_layout"], "duplicate_layer0": o["duplicate_layer0"],
        **({"arrow_layout": ARROW_LAYOUT} if "arrow" in formats else {}),
        "inputs": inputs, "input_format": o["input_format"],
        "options": flags,
        "run": {"key": key},
    }
    manifest.update(sections)
    return manifest


def key_index_section(key_prefix: str) -> dict:
    """The manifest's `key_index`: where each shard's sentence keys are (docs/reuse.md)."""
    return {"folder": KEYS, "columns": ["id", "key"], "key_prefix": key_prefix,
            "rows": "row r of keys/part-i is row r of shard i (sorted by sentence id)",
            "key": "key_prefix + the first 32 hex digits of the sha256 of the tokens as a JSON list"}


def run_section(key: str, resumed_records: list[dict]) -> dict:
    """The manifest's `run`: the run key and what it took over from an interrupted run (commit records)."""
    return {"key": key, "resumed_shards": len(resumed_records),
            "resumed_sentences": sum(r["sentences"] for r in resumed_records)}


def record_counts(stats: dict, dead: list[ShardInfo]) -> dict:
    """Counts that account for every input record, from the per-file read stats and the staged dead-letter
    files: input_records = documents + blank_records + record_dead_letters."""
    by_reason: dict[str, int] = {}
    for d in dead:
        for k, v in d.extra.get("by_reason", {}).items():
            by_reason[k] = by_reason.get(k, 0) + v
    return {"input_records": stats.get("input_records", 0), "blank_records": stats.get("blank_records", 0),
            "record_dead_letters": sum(d.sentences - d.extra.get("sentence_level", 0) for d in dead),
            "dead_letters_by_reason": dict(sorted(by_reason.items()))}


def complete(manifest: dict, shards: list[ShardInfo], dead: list[ShardInfo]) -> tuple[dict, list[list[str]]]:
    """The manifest with shard listing and counts filled in, and the moves [staged url, final relative name]
    that put every file under its final name. Shards are numbered in order of their first sentence id."""
    shards = sorted(shards, key=lambda s: s.first_id)
    dead = sorted(dead, key=lambda s: s.first_id)
    listing, moves = [], []
    for i, s in enumerate(shards):
        entry = {"sentences": s.sentences, "tokens": s.tokens}
        for fmt, src in sorted(s.files.items()):
            rel = part_name(fmt, i, len(shards))
            moves.append([src, rel])
            entry[fmt] = rel
        listing.append(entry)
    dead_files = []
    for i, s in enumerate(dead):
        rel = part_name(DEAD_LETTERS, i, len(dead))
        moves.append([s.files[DEAD_LETTERS], rel])
        dead_files.append({"path": rel, "records": s.sentences})
    counts = manifest.setdefault("counts", {})
    counts["sentences_written"] = sum(s.sentences for s in shards)
    counts["tokens_written"] = sum(s.tokens for s in shards)
    counts["dead_letters"] = sum(s.sentences for s in dead)
    counts["dead_letter_sentences"] = sum(s.extra.get("sentence_level", 0) for s in dead)
    counts["sentences"] = counts["sentences_written"] + counts["dead_letter_sentences"]
    reused = dict.fromkeys(manifest.get("reuse", {}).get("sources", []), 0)   # by source (--reuse), this run's
    for s in shards:                    # and those of an interrupted run it resumed
        for src, n in s.extra.get("reused", {}).items():
            reused[src] = reused.get(src, 0) + n
    if manifest.get("dedupe") or reused:    # written = embedded + deduplicated (another sentence's vectors) + reused
        counts["sentences_deduplicated"] = sum(s.extra.get("deduplicated", 0) for s in shards)
        if reused:
            counts["sentences_reused"] = sum(reused.values())
            counts["sentences_reused_by_source"] = reused
        counts["sentences_embedded"] = (counts["sentences_written"] - counts["sentences_deduplicated"]
                                        - counts.get("sentences_reused", 0))
    with_kernel_paths(manifest, shards)
    manifest.update(schema_version=SCHEMA_VERSION, shards=listing, dead_letter_files=dead_files)
    return manifest, moves


def with_kernel_paths(manifest: dict, shards: list[ShardInfo]) -> None:
    """The manifest's `kernel_path` from what computed the vectors: the kernel paths the shards' commit records name
    (each worker's own, output/staging.py; records of one path, model.kernels.kernel_key, counted once). A shard of an
    earlier version, or whose record is damaged, counts as on the planned path (on a remote run, planned as null:
    unknown). One path: `kernel_path` is it (a remote run's too); several: `kernel_path` is null and
    `worker_kernel_paths` lists them; with a shard unknown: null, none listed. `dedupe.exact` is false once two paths
    are known (a copy may have other bits than its own worker's run would give), never raised. No embedded sentence:
    as planned."""
    from elmo_pipeline.model.kernels import exact_here, kernel_key
    planned, found, unknown = manifest.get("kernel_path"), {}, False
    for s in shards:
        recorded = s.extra.get("kernel_paths")
        if recorded is None or not all(well_formed_kernel(r) for r in recorded):
            if planned is None:
                unknown = True
                continue
            recorded = [planned]
        for record in recorded:
            found.setdefault(kernel_key(record), record)
    paths = [found[k] for k in sorted(found)]
    dedupe = manifest.get("dedupe")
    if isinstance(dedupe, dict) and paths:
        dedupe["exact"] = len(paths) == 1 and exact_here(paths[0], dedupe.get("exact", False))
    if paths and not unknown:
        manifest["kernel_path"] = paths[0] if len(paths) == 1 else None
        if len(paths) > 1:
            manifest["worker_kernel_paths"] = paths


def is_file_record(rec) -> bool:
    """Whether `rec` is a whole file record: {"bytes": a non-negative int, "sha256": 64 lowercase hex digits}."""
    return (isinstance(rec, dict) and type(rec.get("bytes")) is int and rec["bytes"] >= 0
            and isinstance(h := rec.get("sha256"), str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h))


def file_records(moves: list[list[str]], shards: list[ShardInfo], written: dict[str, dict]) -> dict[str, dict]:
    """{final name: {"bytes", "sha256"}} of every file the plan moves whose record is known: a shard's from its
    commit record (taken as the worker wrote it), the others' from this Sink's writes. A shard committed by a
    version without digests stays unrecorded (read as before, not verified)."""
    known = {src: rec for s in shards if isinstance(d := s.extra.get("digests"), dict)
             for fmt, src in s.files.items() if is_file_record(rec := d.get(fmt))}
    known.update(written)
    return {rel: known[src] for src, rel in sorted(moves, key=lambda m: m[1]) if src in known}


def with_upsert(manifest: dict, counts: dict, section: dict) -> dict:
    """The upsert's part (formats/iceberg/upsert.py): its documents' change counts and its `upsert` entry."""
    manifest.setdefault("counts", {}).update(counts)
    manifest["upsert"] = section
    return manifest


def with_table(manifest: dict, table: str, catalog: str | None) -> bool:
    """Add a table to the tables the output was registered in (formats.iceberg.recorded_tables) unless it is
    there; True when it was added."""
    from elmo_pipeline.formats.iceberg import MANIFEST_ENTRY, recorded_tables
    entry = {"table": table, "catalog": redact(catalog)}
    if any((e["table"], e["catalog"]) == (entry["table"], entry["catalog"]) for e in recorded_tables(manifest)):
        return False
    manifest.setdefault(MANIFEST_ENTRY, []).append(entry)
    return True


def to_bytes(manifest: dict) -> bytes:
    """manifest.json's bytes: indented, keys sorted."""
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def write(sink, root: str, manifest: dict, create: bool = False) -> None:
    """Write <root>/manifest.json through `sink` (output/sink.py: write-then-rename, fenced, inside the root);
    create=True: never over a manifest there (one placed since the caller looked)."""
    sink.put(posixpath.join(root, MANIFEST), to_bytes(manifest), create=create)
