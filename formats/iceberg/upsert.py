"""Change-only runs into an Iceberg table that mirrors the corpus (--iceberg-mode upsert). No Beam import.

A document is keyed by its id (--id-field) and doc_hash(): its text under the settings that shape its rows.
Each upsert snapshot's summary names (STATE_PROPERTY) a Parquet file, DOC_HASHES in the output that made it,
holding the table's documents at that snapshot: doc_id, doc_hash, change (CHANGES). The next run reads the
current snapshot's file (read_state: its three small columns), embeds only the documents whose hash differs
or that are new, and commits in ONE snapshot (_upsert_producer): its Parquet shards added as they are, and Iceberg v2
position-delete files (one per affected data file, in the table's data folder) removing the live rows of
the changed documents and, with --delete-missing, of those no longer in the input. Unchanged rows' files are
not rewritten; only their `doc_id` column is read. Exactly once: the registration property of the run
key (formats.iceberg.registration_property) is set in the same commit; a rerun finds it. Time travel: any
snapshot's rows, and its state file.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.formats.iceberg.commit import (FILES_PROPERTY, OUTPUT_PROPERTY, REGISTERED_PREFIX, RUN_KEY_PROPERTY,
                                                  Registration, _marked, add_snapshot, check_new_ids, check_table_file,
                                                  check_table_files, commit,
                                                  registration_property, run_ids)
from elmo_pipeline.formats.iceberg.table import IcebergTarget, data_file_urls, output_url
from elmo_pipeline.formats.layout import DOC_HASHES, recorded_files, recorded_kernel_paths, well_formed_kernel
from elmo_pipeline.fsio import NotTheRecordedFile, json_lines, json_or_none, redact

logger = logging.getLogger("elmo-pipeline.iceberg")
MODES = ("append", "upsert")
STATE_PROPERTY = "elmo-pipeline.doc-hashes"    # snapshot summary: the URL of its DOC_HASHES (formats/layout.py)
STATE_RECORD_PROPERTY = "elmo-pipeline.doc-hashes-record"   # ... and that file's {"bytes", "sha256"} (JSON)
KERNEL_PATH_PROPERTY = "elmo-pipeline.kernel-path"  # ... and what computed the rows it added (model/kernels.py, JSON;
#                                                   a list when the workers computed on several)
EMBED_FAILED = "embedding failed:"   # the dead-letter reason of a sentence whose batch failed (transforms/embed_items.py)
INCOMPLETE = "incomplete"       # the doc_hash of a document one of whose sentences failed to embed: never current
# the reason of a record dead letter standing for the rest of an input file that could not be read (transforms/read.py,
# transforms/lines.py: truncated or corrupted compressed data, another encoding, a damaged Parquet file): its records'
# ids are unknown, so with it --delete-missing removes nothing this run (a file cut short while copied is no deletion)
UNREADABLE_FILE = "unreadable file:"
ROW_DOC = "doc_id"                             # the shards' column naming each row's document
# unchanged/changed/added: documents of the input; removed: gone from the input (--delete-missing);
# kept: gone from the input, rows kept (without --delete-missing)
CHANGES = ("unchanged", "changed", "added", "removed", "kept")
STATE_SCHEMA = pa.schema([("doc_id", pa.string()), ("doc_hash", pa.string()), ("change", pa.string())])
FILE_PATH_ID, POS_ID = 2147483546, 2147483545  # Iceberg's reserved field ids of a position-delete file
DELETE_SCHEMA = pa.schema([
    pa.field("file_path", pa.string(), nullable=False, metadata={b"PARQUET:field_id": str(FILE_PATH_ID).encode()}),
    pa.field("pos", pa.int64(), nullable=False, metadata={b"PARQUET:field_id": str(POS_ID).encode()})])


class TableMovedError(ValueError):
    """The table's current snapshot is not the one an upsert compared its documents with (pipeline/exits.py:
    USAGE, exit 2: run that day again into a new --output: this one holds the change against another state)."""


def settings_salt(key_prefix: str, sentence_limit: int, max_document_tokens: int) -> str:
    """What doc_hash() mixes in besides the text: the vectors' key prefix (model and every setting that changes
    vectors, model/resolve.py) and the limits that make sentences dead letters. Another value makes every
    document 'changed'."""
    return f"{key_prefix}|{sentence_limit}|{max_document_tokens}"


def doc_hash(text: str, split_sentences: bool, salt: str) -> str:
    """A document's content hash: the first 32 hex digits of the sha256 of salt, sentence splitting and text."""
    raw = f"{salt}\x00{int(split_sentences)}\x00{text}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:32]


def change_of(doc_id: str, digest: str, state: dict[str, str]) -> str:
    """unchanged, changed or added: a document of the input against the table's state {doc_id: doc_hash}."""
    old = state.get(doc_id)
    return "added" if old is None else "unchanged" if old == digest else "changed"


def new_state(old: dict[str, str], seen: dict[str, tuple[str, str]], delete_missing: bool) -> pa.Table:
    """The table's documents after this run (STATE_SCHEMA, sorted by doc_id): `seen` {doc_id: (doc_hash, change)}
    of the input, and the ids of `old` not seen: removed (doc_hash null) with `delete_missing`, else kept."""
    rows = dict(seen)
    for d, h in old.items():
        if d not in rows:
            rows[d] = (None, "removed") if delete_missing else (h, "kept")
    ids = sorted(rows)
    return pa.table([pa.array(ids, pa.string()), pa.array([rows[d][0] for d in ids], pa.string()),
                     pa.array([rows[d][1] for d in ids], pa.string())], schema=STATE_SCHEMA)


def change_counts(state: pa.Table) -> dict[str, int]:
    """{documents_<change>: n} of a state table (every change of CHANGES, 0 when absent)."""
    got = dict(zip(*(c.to_pylist() for c in pc.value_counts(state.column("change")).flatten())))\
        if state.num_rows else {}
    return {f"documents_{c}": int(got.get(c, 0)) for c in CHANGES}


def delete_positions(remove: pa.Array, doc_ids: pa.Array, deleted: pa.Array | None = None) -> pa.Array:
    """Row positions (int64, ascending) of a data file whose `doc_ids` (its doc_id column, row by row) are in
    `remove`, less the positions already `deleted` by earlier delete files."""
    hit = pc.is_in(doc_ids, value_set=remove)
    positions = pc.indices_nonzero(pc.fill_null(hit, False)).cast(pa.int64())
    if deleted is not None and len(deleted):
        positions = positions.filter(pc.invert(pc.is_in(positions, value_set=deleted.cast(pa.int64()))))
    return positions


def read_state_file(io, url: str, record: dict | None, columns: list[str]) -> pa.Table:
    """A document state file, checked against the record of the output that wrote it ({"bytes", "sha256"}; None
    for a snapshot of a version that recorded none): at most its recorded size read; ValueError when it is not
    that file (replaced, restored from another day, cut short; no regular file: a FIFO is never opened)."""
    try:
        check_table_file(io, url, None if record is None else int(record["bytes"]))
    except NotTheRecordedFile as e:
        raise ValueError(f"--iceberg-mode upsert: the document state {redact(url)} is not the file its snapshot "
                         f"recorded ({redact(str(e))}): it was replaced since; upsert into a new table, or put the "
                         "recorded file back") from None
    with io.new_input(url).open() as f:
        data = f.read() if record is None else f.read(int(record["bytes"]) + 1)
    if record is not None and (len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]):
        raise ValueError(f"--iceberg-mode upsert: the document state {redact(url)} is not the file its snapshot "
                         f"recorded ({len(data)} bytes read, {record['bytes']} recorded, or another digest): it was "
                         "replaced or restored since; upsert into a new table, or put the recorded file back")
    return pq.ParquetFile(pa.BufferReader(data)).read(columns=columns)


def read_state(table) -> tuple[int | None, dict[str, str], list | None]:
    """(current snapshot id, {doc_id: doc_hash}, the kernel paths its rows were computed on: None when not recorded)
    of a table for an upsert: {} for a table without snapshots; ValueError when its current snapshot was not made by
    an upsert (no state to compare with)."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return None, {}, None
    props = snapshot.summary.additional_properties if snapshot.summary else {}
    url = props.get(STATE_PROPERTY)
    if not url:
        raise ValueError(f"--iceberg-mode upsert: the current snapshot {snapshot.snapshot_id} of Iceberg table "
                         f"{'.'.join(table.name())} was not made by an upsert (it names no document state): upsert "
                         "into a new table, or one whose every snapshot an upsert made")
    record = json.loads(props[STATE_RECORD_PROPERTY]) if STATE_RECORD_PROPERTY in props else None
    state = read_state_file(table.io, url, record, ["doc_id", "doc_hash", "change"])
    state = state.filter(pc.not_equal(state.column("change"), "removed"))
    kernels = json_or_none(props[KERNEL_PATH_PROPERTY]) if KERNEL_PATH_PROPERTY in props else None
    if isinstance(kernels, dict):     # one path; a list when the workers computed on several
        kernels = [kernels]
    return (snapshot.snapshot_id, dict(zip(state.column("doc_id").to_pylist(), state.column("doc_hash").to_pylist())),
            kernels)


def _deleted_in(io, delete_files, path: str) -> pa.Array | None:
    """Positions of data file `path` that earlier position-delete files remove."""
    parts = []
    for d in delete_files:
        with io.new_input(d.file_path).open() as f:
            t = pq.ParquetFile(f).read(columns=["file_path", "pos"])
        parts += t.filter(pc.equal(t.column("file_path"), path)).column("pos").chunks
    return pa.chunked_array(parts, pa.int64()).combine_chunks() if parts else None


def live_deletes(table, remove: pa.Array) -> list[tuple[str, pa.Array]]:
    """(data file path, positions) of the current snapshot's live rows whose document is in `remove`: the doc_id
    column alone is read, and the delete files, of the data files whose doc_id bounds may hold one of them
    (pyiceberg prunes by the bounds for up to 200 ids; more, and every data file is read)."""
    from pyiceberg.expressions import In
    if table.current_snapshot() is None or not len(remove):
        return []
    out = []
    for task in check_table_files(table, table.scan(row_filter=In(ROW_DOC, set(remove.to_pylist()))).plan_files()):
        path = task.file.file_path
        with table.io.new_input(path).open() as f:
            ids = pq.ParquetFile(f).read(columns=[ROW_DOC]).column(0).combine_chunks()
        if pa.types.is_dictionary(ids.type):
            ids = ids.dictionary_decode()
        positions = delete_positions(remove, ids, _deleted_in(table.io, task.delete_files, path))
        if len(positions):
            out.append((path, positions))
    return out


def write_delete_file(table, name: str, data_path: str, positions: pa.Array):
    """An Iceberg v2 position-delete file for one data file (`positions` ascending: rows sorted by file_path,
    pos), written in the table's data folder; its DataFile, with the path bounds that scope it to that file."""
    from pyiceberg.conversions import to_bytes
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record
    from pyiceberg.types import LongType, StringType
    url = table.location_provider().new_data_location(name)
    t = pa.table([pa.array([data_path] * len(positions), pa.string()), positions], schema=DELETE_SCHEMA)
    with table.io.new_output(url).create(overwrite=True) as f:
        pq.write_table(t, f)
    lo, hi = (v.as_py() for v in pc.min_max(positions).values())
    return DataFile.from_args(
        content=DataFileContent.POSITION_DELETES, file_path=url, file_format=FileFormat.PARQUET, partition=Record(),
        record_count=len(positions), file_size_in_bytes=len(table.io.new_input(url)),
        lower_bounds={FILE_PATH_ID: to_bytes(StringType(), data_path), POS_ID: to_bytes(LongType(), lo)},
        upper_bounds={FILE_PATH_ID: to_bytes(StringType(), data_path), POS_ID: to_bytes(LongType(), hi)},
        spec_id=table.spec().spec_id, sort_order_id=None, equality_ids=None, key_metadata=None)


@dataclass(frozen=True)
class UpsertRegistration(Registration):
    """What Upsert.register() did: Registration's, and the position-delete files and rows it committed."""
    delete_files: int = 0
    deleted_rows: int = 0

    def describe(self) -> str:
        if not self.added:
            return super().describe()
        return (f"Iceberg table {self.table}: snapshot {self.snapshot_id} (upsert: {self.files} file"
                f"{'' if self.files == 1 else 's'} added, {self.deleted_rows} rows deleted by {self.delete_files} "
                "position-delete file" + ("" if self.delete_files == 1 else "s") + ")")


def _registered(table, base: str, key: str) -> int | None:
    """The snapshot that registered run `key`'s output at `base` (or the current one when only the table
    property says so), else None."""
    marked = [s.snapshot_id for s in _marked(table, base)
              if s.summary.additional_properties.get(RUN_KEY_PROPERTY) == key]
    if marked:
        return marked[-1]
    if table.properties.get(registration_property(key, base)) == redact(base) and table.current_snapshot():
        return table.current_snapshot().snapshot_id
    return None


@dataclass
class Upsert:
    """--iceberg-mode upsert of one run: the table, the state it compares with (read at plan time), the salt of
    doc_hash(), and --delete-missing."""
    target: IcebergTarget
    base_snapshot: int | None
    state: dict[str, str] = field(repr=False)
    salt: str = ""
    delete_missing: bool = False
    kernel_path: list | None = None    # the kernel paths that computed the table's rows (its current snapshot's record)
    kernel_note: str = "not compared"  # that against this run's (pipeline.reuse_sources.kernel_note): unchanged rows stay

    @classmethod
    def plan(cls, target: IcebergTarget, salt: str, delete_missing: bool,
             storage_options: dict | None = None) -> "Upsert":
        """The table's current state (reading only; no table yet: empty)."""
        path = target.sqlite_path()
        table = None
        if not path or os.path.exists(path):
            table = target._load_table(target.load_catalog(storage_options, read_only=True))   # noqa: SLF001
        base, state, kernels = read_state(table) if table is not None else (None, {}, None)
        return cls(target, base, state, salt, delete_missing, kernels)

    def state_after(self, doc_files: Iterable[bytes], dead=()) -> pa.Table:
        """The table's documents after this run (new_state): the staged documents (files of [doc_id, doc_hash,
        change] lines, a retried bundle's twice) against the state read at plan time. A document one of whose
        sentences failed to embed (`dead`: the run's dead letters; a failure that may not recur) is recorded
        INCOMPLETE, so the next run embeds it again."""
        failed = {d.id.rpartition("#")[0] for d in dead if d.level == "sentence" and d.reason.startswith(EMBED_FAILED)}
        unread = [d.id for d in dead if d.reason.startswith(UNREADABLE_FILE)]
        seen: dict[str, tuple[str, str]] = {}
        for data in doc_files:
            for line in json_lines(data):
                d, h, c = json.loads(line)
                seen[d] = (INCOMPLETE if d in failed else h, c)
        if unread and self.delete_missing:
            logger.warning("--delete-missing: %d input file(s) could not be read whole (e.g. %s, dead letter "
                           "'unreadable file'): the table's documents not in the input are kept this run, not "
                           "removed", len(unread), redact(unread[0]))
        return new_state(self.state, seen, self.delete_missing and not unread)

    @staticmethod
    def state_bytes(state: pa.Table) -> bytes:
        """A state table as the Parquet file DOC_HASHES holds."""
        out = pa.BufferOutputStream()
        pq.write_table(state, out)
        return out.getvalue().to_pybytes()

    change_counts = staticmethod(change_counts)

    def kernel_paths_after(self, manifest: dict) -> list | None:
        """The kernel paths that computed the table's rows once this run's are committed (KERNEL_PATH_PROPERTY): this
        run's (formats.layout.recorded_kernel_paths of its manifest) where it keeps no row of another run's, or
        keeps rows of its own path ('same'); else those of the rows it keeps as well, each once (None, not recorded,
        when theirs are not: a remote run, or one with --reuse-across-kernels, never passes their path off as its
        own)."""
        ours = recorded_kernel_paths(manifest)
        if not self.state or self.kernel_note == "same" or ours is None:
            return ours
        if not (isinstance(self.kernel_path, list) and all(well_formed_kernel(k) for k in self.kernel_path)):
            return None
        both = {json.dumps(k, sort_keys=True): k for k in [*self.kernel_path, *ours]}
        return [both[k] for k in sorted(both)]

    def section(self) -> dict:
        """The manifest's `upsert` entry."""
        return {"table": self.target.table, "doc_hashes": DOC_HASHES, "base_snapshot": self.base_snapshot,
                "delete_missing": self.delete_missing, "kernel_path": self.kernel_note}

    def register(self, output: str, manifest: dict, schema: pa.Schema, storage_options: dict | None = None,
                 before_commit=None, check_files=None) -> Registration:
        """Commit the finished output's change (see the module docstring) in one snapshot, unless this run key's
        output is registered already. TableMovedError when the table moved since the run compared with it;
        DuplicateIdError when the table would then hold an id twice (formats.iceberg.check_new_ids)."""
        files = data_file_urls(output, manifest)
        base, key = output_url(output), str((manifest.get("run") or {}).get("key"))
        state_url = f"{base}/{manifest['upsert']['doc_hashes']}"
        catalog = self.target.load_catalog(storage_options)
        table = self.target._table_or_create(catalog, schema)     # noqa: SLF001
        ids = functools.cache(lambda: run_ids(table.io, files))

        def prepare(table):
            current = table.current_snapshot()
            if (current.snapshot_id if current else None) != manifest["upsert"]["base_snapshot"]:
                raise TableMovedError(
                    f"--iceberg-mode upsert: Iceberg table {self.target.table} changed since this run compared its "
                    f"documents with snapshot {manifest['upsert']['base_snapshot']} (now "
                    f"{current.snapshot_id if current else None}); nothing was committed: run that day again into a "
                    "new --output")
            try:                            # read here: an output registered already needs none of it
                record = (recorded_files(manifest) or {}).get(DOC_HASHES)
            except ValueError as e:
                raise ValueError(f"--iceberg-mode upsert: --output {redact(base)}: {e}; run that day again into a "
                                 "new --output") from None
            state = read_state_file(table.io, state_url, record, ["doc_id", "change"])
            remove = state.filter(pc.is_in(state.column("change"), value_set=pa.array(["changed", "removed"])))
            remove = remove.column("doc_id").combine_chunks()
            check_new_ids(table, ids(), base, replaced=remove)
            name = registration_property(key, base)[len(REGISTERED_PREFIX):]    # this run's output: its own names
            return current, [write_delete_file(table, f"{name}-{i:05d}-deletes.parquet", path, positions)
                             for i, (path, positions) in enumerate(live_deletes(table, remove))], record

        def write(tx, prepared):
            current, deletes, record = prepared
            kernels = self.kernel_paths_after(manifest)
            props = {OUTPUT_PROPERTY: redact(base), RUN_KEY_PROPERTY: key, FILES_PROPERTY: str(len(files)),
                     STATE_PROPERTY: redact(state_url),
                     **({KERNEL_PATH_PROPERTY: json.dumps(kernels[0] if len(kernels) == 1 else kernels,
                                                          sort_keys=True)} if kernels else {}),
                     **({STATE_RECORD_PROPERTY: json.dumps(record, sort_keys=True)} if record else {})}
            add_snapshot(tx, table.io, files, props, overwrite=current is not None, deletes=deletes)
        done, prepared = commit(self.target, catalog, table, base, key, len(files),
                                lambda t: _registered(t, base, key), prepare, write, before_commit, check_files)
        if prepared is None:
            return done
        deletes = prepared[1]
        return UpsertRegistration(done.table, done.snapshot_id, True, done.files, len(deletes),
                                  sum(d.record_count for d in deletes))
