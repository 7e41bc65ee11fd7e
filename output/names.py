"""Every name of an output folder, derived from the formats (formats.layout.FORMATS) and fsio.temp_name().

    <out>/parquet/part-00000-of-00002.parquet   <out>/hdf5/part-00000-of-00002.hdf5   (same sentences in shard i)
    <out>/arrow/part-00000-of-00002.arrow       (with --format arrow: formats/arrow.py)
    <out>/dead_letters/part-00000-of-00001.jsonl                                       (only when there are any)
    <out>/keys/part-00000-of-00002.parquet      (stateless, warm: the key index, row r = shard i's row r)
    <out>/manifest.json, <out>/report.html, <out>/metrics.prom                         (by Finalize, after all shards)
    <out>/doc_hashes.parquet    (--iceberg-mode upsert: the table's documents after it, formats/iceberg/upsert.py)
    <out>/_SUCCESS                                                                     (written last)
    <out>/_staging/<run key>/   while a run is live: <uuid>.<format> (shard files), committed/<uuid>.json (commit
                               records), dead/<uuid>.jsonl (dead letters), counts/<file hash>.json (per
                               input file), stats/<uuid>.json (run statistics for the report),
                               docs/<uuid>.jsonl (documents' content hashes, --iceberg-mode upsert),
                               finalize.json (the plan of a started finalize), run.json
    <out>/_lease.json           while a run is live: who holds the output (output/lease.py)

Ownership (output/state.py): the pipeline deletes or replaces only what it can show it wrote: the files its
manifest.json lists (and manifest.json, _SUCCESS beside it), the final names a finalize plan moves files to,
everything under _staging/, the lease, and the temporary files of its own writes (is_scratch_name). Any other
file in SHARD_FOLDERS or at a name Finalize writes makes a run refuse (readers glob those folders); other
files are left alone. No name is ever reached through a symbolic link (output/state.py refuses them).
"""
from __future__ import annotations

import hashlib
import re

from elmo_pipeline.formats.layout import DOC_HASHES, FORMATS, MANIFEST, SUCCESS
from elmo_pipeline.fsio.fs import TEMP_NAME

STAGING = "_staging"          # <out>/_staging/<run key>/
RECORDS = "committed"         # <staging>/committed/<shard name>.json: the shard is complete
PLAN = "finalize.json"        # <staging>/finalize.json: the moves and manifest of a started finalize
RUN_FILE = "run.json"         # <staging>/run.json: what the run key hashes
DEAD = "dead"                 # <staging>/dead/<uuid>.jsonl: staged dead letters
COUNTS = "counts"             # <staging>/counts/<hash of the file URL>.json: its record counts
STATS = "stats"               # <staging>/stats/<uuid>.json: run statistics (output/stats.py)
DOCS = "docs"                 # <staging>/docs/<uuid>.jsonl: each document's content hash (--iceberg-mode upsert)
REPORT = "report.html"        # <out>/report.html: the run report (output/report.py)
METRICS = "metrics.prom"      # <out>/metrics.prom: counts and stage times (formats/metrics.py)
LEASE = "_lease.json"         # <out>/_lease.json: the live run holding the output
PROBE = "_write_probe-"       # <out>/_write_probe-<uuid hex>: an object store's write probe
DEAD_LETTERS = "dead_letters"
KEYS = "keys"                 # <out>/keys/: each shard's sentence ids and sentence keys (output/staging.py)
SUFFIX = {**{fmt: fmt for fmt in FORMATS}, DEAD_LETTERS: "jsonl", KEYS: "parquet"}    # folder -> its files' suffix
SHARD_FILES = (*FORMATS, KEYS)                   # the files of a shard, by its manifest entry's keys
SHARD_FOLDERS = (*SHARD_FILES, DEAD_LETTERS)     # readers glob these: only listed files may be there
TOP_FILES = (MANIFEST, REPORT, METRICS, SUCCESS)  # Finalize's files at the top of the output
FINAL_NAMES = (*SHARD_FOLDERS, *TOP_FILES)
ATOMIC_TOP = (MANIFEST, SUCCESS, LEASE)          # top files written with fsio.atomic_write (temporary names)

_PART = r"part-\d{5}-of-\d{5}"
_FINAL_FILE = re.compile("|".join([*(f"{re.escape(d)}/{_PART}\\.{re.escape(s)}" for d, s in SUFFIX.items()),
                                   re.escape(REPORT), re.escape(METRICS), re.escape(DOC_HASHES)]))
_SCRATCH = re.compile("|".join([re.escape(LEASE), f"{re.escape(PROBE)}[0-9a-f]{{32}}",
                                *(re.escape(n) + TEMP_NAME.pattern.rstrip("$") for n in ATOMIC_TOP)]))


def part_name(folder: str, i: int, n: int) -> str:
    """Final name of file i of n in a shard folder, relative to the output: 'parquet/part-00000-of-00002.parquet'."""
    return f"{folder}/part-{i:05d}-of-{n:05d}.{SUFFIX[folder]}"


def counts_name(url: str, part: int | None = None) -> str:
    """<staging>-relative name of an input file's record counts, or of its part `part` when it is read in parts
    (transforms/splits.py): the same for every attempt at the file or part."""
    name = hashlib.sha256(url.encode('utf-8', 'surrogatepass')).hexdigest()[:32]
    return f"{COUNTS}/{name}.json" if part is None else f"{COUNTS}/{name}-{part}.json"


def is_final_name(rel: str) -> bool:
    """True for a name (relative to the output folder) that Finalize moves a file to: a shard or dead-letter
    file named as part_name() makes them, the report, metrics.prom."""
    return isinstance(rel, str) and _FINAL_FILE.fullmatch(rel) is not None


def is_scratch_name(rel: str) -> bool:
    """True for the lease and the leftovers of the pipeline's own writes cut short, at the top of the output."""
    return _SCRATCH.fullmatch(rel) is not None


def listed_names(manifest: dict) -> set[str]:
    """The final names a manifest lists (shard files, dead-letter files, the report, metrics.prom): only names
    of this layout (is_final_name), whatever else an edited manifest may hold."""
    names = [s.get(f) for s in manifest.get("shards", []) if isinstance(s, dict) for f in SHARD_FILES]
    names += [d.get("path") for d in manifest.get("dead_letter_files", []) if isinstance(d, dict)]
    names += [manifest.get("report"), manifest.get("metrics"), (manifest.get("upsert") or {}).get("doc_hashes")]
    return {n for n in names if is_final_name(n)}
