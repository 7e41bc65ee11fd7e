"""An output's content: the formats, dead letters, shards and their commit records, the manifest read back.

The output folder's names and its protocol (staging, commit, finalize, ownership, the manifest written) are output/'s.
Ids: a sentence is "<doc id>#<index>". Readers trust manifest.json (or _SUCCESS) only.
No Beam import.
"""
from __future__ import annotations

import base64
import json
import posixpath
import zlib
from dataclasses import dataclass, field

from elmo_pipeline.fsio.fs import read_json, store_failing
from elmo_pipeline.fsio.redact import redact

SCHEMA_VERSION = 1
FORMATS = ("parquet", "hdf5", "arrow")        # output file formats (--format; arrow: formats/arrow.py)
PARQUET_LAYOUTS = ("sentence", "token")       # --parquet-layout
ARROW_LAYOUT = "token-rows"                   # the manifest's arrow_layout (formats/arrow.py)
STORAGE_DTYPES = ("float32", "float16")       # --dtype: precision of the stored vectors
MANIFEST, SUCCESS = "manifest.json", "_SUCCESS"
DOC_HASHES = "doc_hashes.parquet"   # --iceberg-mode upsert: the table's documents after it (formats/iceberg/upsert.py)
EXCERPT_CHARS = 200                           # dead letters keep the first 200 characters


def sentence_id(doc_id: str, index: int) -> str:
    return f"{doc_id}#{index}"


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
        if self.extra.get("deduplicated"):      # sentences written with another sentence's vectors (--dedupe)
            rec["deduplicated"] = self.extra["deduplicated"]
        if self.extra.get("reused"):            # sentences written with a --reuse source's vectors, by source
            rec["reused"] = self.extra["reused"]
        if self.extra.get("digests"):           # {format: {"bytes", "sha256"}} of each file, taken as written
            rec["digests"] = self.extra["digests"]
        if "kernel_paths" in self.extra:        # what computed its embedded sentences (model/kernels.py records)
            rec["kernel_paths"] = self.extra["kernel_paths"]
        if self.extra.get("run"):               # the run key of the staging folder it was written into
            rec["run"] = self.extra["run"]
        if lengths is not None:
            rec["lengths"] = {str(k): v for k, v in sorted(lengths.items())}
        return rec

    @classmethod
    def from_record(cls, record: dict, staging_root: str) -> "ShardInfo":
        """The ShardInfo of a commit record."""
        files = {fmt: posixpath.join(staging_root, name) for fmt, name in record["files"].items()}
        kernels = record.get("kernel_paths")     # a damaged list: not recorded
        return cls(files, record["sentences"], record["tokens"], record["first_id"],
                   {**{k: record[k] for k in ("deduplicated", "reused", "digests") if record.get(k)},
                    **({"kernel_paths": kernels} if isinstance(kernels, list)
                       and all(isinstance(k, dict) for k in kernels) else {})})


# commit record keys that only versions recording each file's size and SHA-256 ("digests") write: a record with
# one of them and no whole digest for a file was edited or damaged, not written by an earlier version.
RECORD_KEYS_WITH_DIGESTS = ("digests", "kernel_paths", "run")


def pack_ids(ids: list[str]) -> str:
    """Sentence ids, compact: a sorted JSON list, zlib-compressed, base64 (sorted ids share long prefixes)."""
    return base64.b64encode(zlib.compress(json.dumps(sorted(ids), ensure_ascii=False).encode(), 6)).decode("ascii")


MAX_IDS_BYTES = 256 << 20      # a commit record's ids decompress to at most this (the record file's own bound)


def record_ids(record: dict) -> list[str]:
    """The sentence ids of a commit record (compact "ids_zlib", or the "ids" list of earlier versions); ValueError
    when "ids_zlib" inflates past MAX_IDS_BYTES (never inflated further)."""
    if "ids" in record:
        return record["ids"]
    inflate = zlib.decompressobj()
    data = inflate.decompress(base64.b64decode(record["ids_zlib"]), MAX_IDS_BYTES + 1)
    if len(data) > MAX_IDS_BYTES or inflate.unconsumed_tail:
        raise ValueError(f"ids_zlib inflates past {MAX_IDS_BYTES} bytes")
    if not inflate.eof:
        raise ValueError("ids_zlib is cut short")
    return json.loads(data)


def checked_record(raw: bytes) -> tuple[dict, list[str]] | None:
    """(commit record, its sentence ids) of a record file's bytes, or None when they are no whole record (a
    damaged file: not a JSON object; counts, first id or file names of the wrong kind; a file name that is not
    a plain name in the staging folder; ids that do not decode to `sentences` distinct strings)."""
    try:
        rec = json.loads(raw)
        if not isinstance(rec, dict):
            return None
        ids = record_ids(rec)
    except (KeyError, ValueError, TypeError, RecursionError, zlib.error):     # nested too deep: damaged too
        return None
    files = rec.get("files")
    ok = (type(rec.get("sentences")) is int and type(rec.get("tokens")) is int and rec["tokens"] >= 0
          and isinstance(rec.get("first_id"), str) and isinstance(files, dict)
          and all(isinstance(k, str) and isinstance(v, str) and v not in ("", ".", "..")
                  and v == posixpath.basename(v) for k, v in files.items())
          and isinstance(ids, list) and len(ids) == rec["sentences"] and all(isinstance(i, str) for i in ids)
          and len(set(ids)) == len(ids))
    return (rec, ids) if ok else None


def is_manifest(m) -> bool:
    """True for a manifest this pipeline writes (complete_manifest: a schema version and a shard list)."""
    return isinstance(m, dict) and "schema_version" in m and isinstance(m.get("shards"), list)


def read_manifest(fs, root: str) -> dict | None:
    """The manifest.json of the output folder `root` on `fs`, or None when there is none, or when the file
    there is no manifest of this pipeline (see is_manifest)."""
    try:
        m = read_json(fs, posixpath.join(root, MANIFEST))
    except FileNotFoundError as e:
        if store_failing(e):        # an HTTP store unreachable or failing (5xx): no answer, not "no manifest"
            raise ConnectionError("the store did not answer (a refused connection, a timeout or a 5xx), retry later: "
                                  + redact(posixpath.join(root, MANIFEST))) from e     # the URL last: its redaction
                                                                                        # may mask to the line's end
        return None
    return m if is_manifest(m) else None


# manifest.json keys that only versions recording every file's size and SHA-256 (`files`) write: a manifest with one
# of them and no `files` was edited or damaged, not written by an earlier version.
WITH_FILE_RECORDS = ("kernel_path",)


def recorded_files(manifest: dict) -> dict | None:
    """A manifest's `files` ({name: record}, each checked by its reader: output.manifest.is_file_record); None for
    an output of a version that recorded none (read as before, not verified). ValueError, one phrase, when `files`
    is not an object or is gone from a manifest of a version that writes it (WITH_FILE_RECORDS)."""
    files = manifest.get("files")
    if files is None:
        if any(k in manifest for k in WITH_FILE_RECORDS):
            raise ValueError("its manifest has no file records ('files'), which its version always writes: edited "
                             "or damaged")
        return None
    if not isinstance(files, dict):
        raise ValueError("its manifest's 'files' is not an object")
    return files


# A kernel path record read back (a commit record's, a manifest's, a table's) is refused as damaged beyond these:
# model/kernels.py kernel_path() nests 3 levels deep and holds about a hundred values.
KERNEL_RECORD_DEPTH, KERNEL_RECORD_VALUES = 6, 10_000


def well_formed_kernel(record) -> bool:
    """Whether `record`, read back, can be a kernel path record: a JSON object nested at most KERNEL_RECORD_DEPTH
    levels deep with at most KERNEL_RECORD_VALUES values (walked without recursion: a hostile record never exhausts
    the stack)."""
    if not isinstance(record, dict):
        return False
    stack, seen = [(record, 0)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if isinstance(value, (dict, list)):
            if depth >= KERNEL_RECORD_DEPTH or seen > KERNEL_RECORD_VALUES:
                return False
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return True


def recorded_kernel_paths(manifest: dict):
    """The kernel paths that computed an output's vectors, as its manifest records them: [its `kernel_path`], or its
    `worker_kernel_paths` when its workers computed on several (output.manifest.with_kernel_paths); None when it
    records none (an earlier version's output). A damaged value comes back as it is, for the caller to refuse
    (pipeline.reuse_sources.kernel_note: a list of records, each well_formed_kernel)."""
    several = manifest.get("worker_kernel_paths")
    if several is not None:
        return several
    one = manifest.get("kernel_path")
    return None if one is None else [one]
