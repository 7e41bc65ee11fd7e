"""The output folder: file names, staging and commit records, dead letters, the manifest (built and read).

    <out>/parquet/part-00000-of-00002.parquet   <out>/hdf5/part-00000-of-00002.hdf5   (same sentences in shard i)
    <out>/arrow/part-00000-of-00002.arrow       (with --format arrow: formats/arrow.py)
    <out>/dead_letters/part-00000-of-00001.jsonl                                       (only when there are any)
    <out>/manifest.json, <out>/report.html, <out>/metrics.prom                         (by Finalize, after all shards)
    <out>/_SUCCESS                                                                     (written last)
    <out>/_staging/<run key>/   while a run is live: <uuid>.parquet|.hdf5, committed/<uuid>.json (commit
                               records), dead/<uuid>.jsonl (dead letters), counts/<file hash>.json (per
                               input file), stats/<uuid>.json (run statistics for the report),
                               finalize.json (the plan of a started finalize), run.json
    <out>/_lease.json           while a run is live: who holds the output (fsio/lease.py)

Ownership: the pipeline deletes or replaces only what it can show it wrote (owned_names): the files its
manifest.json lists (and manifest.json, _SUCCESS beside it), the final names a finalize plan moves files to,
everything under _staging/, the lease, and the temporary files of its own writes. Any other file in
SHARD_FOLDERS or at a name Finalize writes makes a run refuse (readers glob those folders); other files are
left alone.

Ids: a sentence is "<doc id>#<index>". Readers trust manifest.json (or _SUCCESS) only.
No Beam import.
"""
from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import re
import zlib
from dataclasses import dataclass, field

SCHEMA_VERSION = 1
FORMATS = ("parquet", "hdf5", "arrow")        # output file formats (--format; arrow: formats/arrow.py)
PARQUET_LAYOUTS = ("sentence", "token")       # --parquet-layout
ARROW_LAYOUT = "token-rows"                   # the manifest's arrow_layout (formats/arrow.py)
STORAGE_DTYPES = ("float32", "float16")       # --dtype: precision of the stored vectors
MANIFEST, SUCCESS = "manifest.json", "_SUCCESS"
STAGING = "_staging"                          # <out>/_staging/<run key>/
RECORDS = "committed"                         # <staging>/committed/<shard name>.json: the shard is complete
PLAN = "finalize.json"                        # <staging>/finalize.json: the moves and manifest of a started finalize
RUN_FILE = "run.json"                         # <staging>/run.json: what the run key hashes
DEAD = "dead"                                 # <staging>/dead/<uuid>.jsonl: staged dead letters
COUNTS = "counts"                             # <staging>/counts/<hash of the file URL>.json: its record counts
STATS = "stats"                               # <staging>/stats/<uuid>.json: run statistics (transforms/stats.py)
REPORT = "report.html"                        # <out>/report.html: the run report (transforms/report.py)
METRICS = "metrics.prom"                      # <out>/metrics.prom: counts and stage times (formats/metrics.py)
LEASE = "_lease.json"                         # <out>/_lease.json: the live run holding the output
DEAD_LETTERS = "dead_letters"
FINAL_NAMES = ("parquet", "hdf5", "arrow", DEAD_LETTERS, MANIFEST, REPORT, METRICS, SUCCESS)
SHARD_FOLDERS = ("parquet", "hdf5", "arrow", DEAD_LETTERS)  # readers glob these: only listed files may be there
PROBE = "_write_probe-"                       # <out>/_write_probe-<uuid hex>: an object store's write probe
_FINAL_FILE = re.compile(r"(parquet/part-\d{5}-of-\d{5}\.parquet|hdf5/part-\d{5}-of-\d{5}\.hdf5|"
                         r"arrow/part-\d{5}-of-\d{5}\.arrow|"
                         r"dead_letters/part-\d{5}-of-\d{5}\.jsonl|report\.html|metrics\.prom)")
# the lease, and what a write of the pipeline's own leaves behind when cut short (fsio.atomic_write's
# "<name>.tmp-<uuid hex>", the probe of pipeline/validate.check_output_writable)
_SCRATCH = re.compile(r"(_lease\.json|manifest\.json\.tmp-[0-9a-f]{32}|_SUCCESS\.tmp-[0-9a-f]{32}|"
                      r"_lease\.json\.tmp-[0-9a-f]{32}|_write_probe-[0-9a-f]{32})")
EXCERPT_CHARS = 200                           # dead letters keep the first 200 characters


def sentence_id(doc_id: str, index: int) -> str:
    return f"{doc_id}#{index}"


def shard_name(fmt: str, i: int, n: int) -> str:
    """Final name of shard i of n, relative to the output folder: 'parquet/part-00000-of-00002.parquet'."""
    return f"{fmt}/part-{i:05d}-of-{n:05d}.{fmt}"


def dead_letter_name(i: int, n: int) -> str:
    return f"{DEAD_LETTERS}/part-{i:05d}-of-{n:05d}.jsonl"


@dataclass(frozen=True)
class DeadLetter:
    """A record or sentence that could not be embedded: id, reason, the first characters of it.

    level "record": an input record that is not a document (id "<file>:<line>" or the id field);
    level "sentence": a sentence of a document (id "<doc id>#<index>"; a document without tokens is
    dead-lettered as its sentence #0, so every document has at least one sentence, written or dead).
    `reason` starts with a fixed kind before its first ':' (the keys of counts.dead_letters_by_reason)."""
    id: str
    reason: str
    excerpt: str
    level: str = "sentence"

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "level": self.level, "reason": self.reason, "excerpt": self.excerpt},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> "DeadLetter":
        d = json.loads(line)
        return cls(d["id"], d["reason"], d["excerpt"], d["level"])


def reason_kind(reason: str) -> str:
    """The short kind of a dead-letter reason: the text before its first ':' ("too long", "no tokens", ...)."""
    return reason.split(":", 1)[0]


def count_dead_letters(letters: list[DeadLetter]) -> dict:
    """{"sentence_level": n, "by_reason": {kind: n}} of one batch of dead letters (by level, not by '#' in
    the id: a file name or an --id-field value may hold a '#')."""
    by_reason: dict[str, int] = {}
    for d in letters:
        by_reason[reason_kind(d.reason)] = by_reason.get(reason_kind(d.reason), 0) + 1
    return {"sentence_level": sum(1 for d in letters if d.level == "sentence"), "by_reason": by_reason}


@dataclass
class ShardInfo:
    """A staged shard: staged file URLs by format, counts, and the smallest sentence id (for naming).
    Dead-letter files are ShardInfos too (files {"dead_letters": url}, sentences = letters, extra = counts)."""
    files: dict[str, str]
    sentences: int
    tokens: int
    first_id: str
    extra: dict = field(default_factory=dict)

    def record(self, ids: list[str], lengths: dict[int, int] | None = None) -> dict:
        """The commit record of this shard (file names relative to the staging folder; ids compact; `lengths`
        {sentence tokens: sentences}, for the run report)."""
        rec = {"files": {fmt: posixpath.basename(p) for fmt, p in self.files.items()},
               "sentences": self.sentences, "tokens": self.tokens, "first_id": self.first_id,
               "ids_zlib": pack_ids(ids)}
        if lengths is not None:
            rec["lengths"] = {str(k): v for k, v in sorted(lengths.items())}
        return rec

    @classmethod
    def from_record(cls, record: dict, staging_root: str) -> "ShardInfo":
        """The ShardInfo of a commit record."""
        files = {fmt: posixpath.join(staging_root, name) for fmt, name in record["files"].items()}
        return cls(files, record["sentences"], record["tokens"], record["first_id"])


def pack_ids(ids: list[str]) -> str:
    """Sentence ids, compact: a sorted JSON list, zlib-compressed, base64 (sorted ids share long prefixes)."""
    return base64.b64encode(zlib.compress(json.dumps(sorted(ids), ensure_ascii=False).encode(), 6)).decode("ascii")


def record_ids(record: dict) -> list[str]:
    """The sentence ids of a commit record (compact "ids_zlib", or the "ids" list of earlier versions)."""
    if "ids" in record:
        return record["ids"]
    return json.loads(zlib.decompress(base64.b64decode(record["ids_zlib"])))


def counts_name(url: str) -> str:
    """<staging>-relative name of an input file's record counts (the same for every attempt at the file)."""
    return f"{COUNTS}/{hashlib.sha256(url.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}.json"


def manifest_header(model: dict, columns: list[tuple[str, int]], hdf5_layout: str, flags: dict,
                    formats: list[str], inputs: list[str], run: dict) -> dict:
    """What a run knows before it starts: model identity, layers and widths, content options, inputs, run key.
    `flags` is every flag of the run (ElmoOptions), some of which are also top-level keys."""
    o = flags
    return {
        "model": model,
        "layers": [c for c, _ in columns], "layer_dims": {c: d for c, d in columns},
        "hdf5_layout": hdf5_layout,
        "dtype": o["dtype"], "compute_dtype": o["compute_dtype"], "state": o["state"], "tokenizer": o["tokenizer"],
        "formats": formats, "parquet_layout": o["parquet_layout"], "duplicate_layer0": o["duplicate_layer0"],
        **({"arrow_layout": ARROW_LAYOUT} if "arrow" in formats else {}),
        "inputs": inputs, "input_format": o["input_format"],
        "options": flags,
        "run": run,
    }


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


def complete_manifest(manifest: dict, shards: list[ShardInfo], dead: list[ShardInfo]) -> tuple[dict, list[list[str]]]:
    """The manifest with shard listing and counts filled in, and the moves [staged url, final relative name]
    that put every file under its final name. Shards are numbered in order of their first sentence id."""
    shards = sorted(shards, key=lambda s: s.first_id)
    dead = sorted(dead, key=lambda s: s.first_id)
    listing, moves = [], []
    for i, s in enumerate(shards):
        entry = {"sentences": s.sentences, "tokens": s.tokens}
        for fmt, src in sorted(s.files.items()):
            rel = shard_name(fmt, i, len(shards))
            moves.append([src, rel])
            entry[fmt] = rel
        listing.append(entry)
    dead_files = []
    for i, s in enumerate(dead):
        rel = dead_letter_name(i, len(dead))
        moves.append([s.files[DEAD_LETTERS], rel])
        dead_files.append({"path": rel, "records": s.sentences})
    counts = manifest.setdefault("counts", {})
    counts["sentences_written"] = sum(s.sentences for s in shards)
    counts["tokens_written"] = sum(s.tokens for s in shards)
    counts["dead_letters"] = sum(s.sentences for s in dead)
    counts["dead_letter_sentences"] = sum(s.extra.get("sentence_level", 0) for s in dead)
    counts["sentences"] = counts["sentences_written"] + counts["dead_letter_sentences"]
    manifest.update(schema_version=SCHEMA_VERSION, shards=listing, dead_letter_files=dead_files)
    return manifest, moves


def manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def is_manifest(m) -> bool:
    """True for a manifest this pipeline writes (complete_manifest: a schema version and a shard list)."""
    return isinstance(m, dict) and "schema_version" in m and isinstance(m.get("shards"), list)


def read_manifest(fs, root: str) -> dict | None:
    """The manifest.json of the output folder `root` on `fs`, or None when there is none, or when the file
    there is no manifest of this pipeline (see is_manifest)."""
    try:
        m = json.loads(fs.cat_file(posixpath.join(root, MANIFEST)))
    except (FileNotFoundError, ValueError):
        return None
    return m if is_manifest(m) else None


def is_final_name(rel: str) -> bool:
    """True for a name (relative to the output folder) that Finalize moves a file to: a shard or dead-letter
    file named as shard_name()/dead_letter_name() make them, the report, metrics.prom."""
    return isinstance(rel, str) and _FINAL_FILE.fullmatch(rel) is not None


def is_scratch_name(rel: str) -> bool:
    """True for the lease and the leftovers of the pipeline's own writes cut short, at the top of the output."""
    return _SCRATCH.fullmatch(rel) is not None


def listed_names(manifest: dict) -> set[str]:
    """The final names a manifest lists (shard files, dead-letter files, the report, metrics.prom): only names
    of this layout (is_final_name), whatever else an edited manifest may hold."""
    names = [s.get(f) for s in manifest.get("shards", []) if isinstance(s, dict) for f in FORMATS]
    names += [d.get("path") for d in manifest.get("dead_letter_files", []) if isinstance(d, dict)]
    names += [manifest.get("report"), manifest.get("metrics")]
    return {n for n in names if is_final_name(n)}
