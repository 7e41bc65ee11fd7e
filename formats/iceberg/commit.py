"""One commit of a finished output into an Iceberg table (commit(): the retry loop, the "already registered"
check, the registration property in the same transaction), the table-side checks it runs (partitioning, ids
held already), and every use of pyiceberg's private names, beside the version pin of setup.py's `iceberg` extra
(pyiceberg >=0.12,<0.13). Append (formats/iceberg/table.py IcebergTarget.register) and upsert
(formats/iceberg/upsert.py) are its users. No Beam import.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import posixpath
from dataclasses import dataclass

import pyarrow as pa

from elmo_pipeline.fsio import NotTheRecordedFile, check_recorded, is_local_url, redact, url_fs

OUTPUT_PROPERTY, RUN_KEY_PROPERTY, FILES_PROPERTY = "elmo-pipeline.output", "elmo-pipeline.run-key", "elmo-pipeline.files"
REGISTERED_PREFIX = "elmo-pipeline.registered."      # + run key + "." + hash of the output URL -> the output URL
ID_COLUMN = "id"
COMMIT_ATTEMPTS = 5          # commits that conflict with another before a registration gives up (retry later)
logger = logging.getLogger("elmo-pipeline.iceberg")


class DuplicateIdError(ValueError):
    """A registration that would add ids the table holds already (pipeline/exits.py: DATA, exit 65)."""


class TableFileChanged(ValueError):
    """A data or delete file the table references is not what the table records of it (pipeline/exits.py: DATA, exit
    65): no regular file, or another size; it is never opened (a FIFO put there would block the read for good)."""


@dataclass(frozen=True)
class Registration:
    """What register() did: the table, the snapshot holding the output's files, whether this call added it."""
    table: str
    snapshot_id: int | None
    added: bool
    files: int

    def describe(self) -> str:
        if self.snapshot_id is None:
            return f"Iceberg table {self.table}: no Parquet shards to register"
        how = "added" if self.added else "already registered"
        return (f"Iceberg table {self.table}: snapshot {self.snapshot_id} ({self.files} file{'' if self.files == 1 else 's'}, "
                f"{how})")


def commit(target, catalog, table, base: str, key: str, files: int, registered, prepare, write,
           before_commit=None, check_files=None) -> tuple[Registration, object]:
    """Register in `target`'s table (an IcebergTarget: its `table` name) run `key`'s output at `base` (`files` Parquet shards) in one commit, retried on a conflict: each
    attempt returns early when registered(table) finds it there already (a snapshot id), runs check_files() when
    given (once: the output's files against their records, before any of them is read), checks the table,
    runs prepare(table) (the mode's checks; its value is handed to write), before_commit(), then write(tx,
    prepared) and the registration property, in one transaction. Another commit first: the table is read again
    and the attempt made again, at most COMMIT_ATTEMPTS times (then RuntimeError chained to the conflict: a
    retry-later failure, pipeline/exits.py: 75). Returns (Registration, prepared: None when found)."""
    from pyiceberg.exceptions import CommitFailedException
    conflict = None
    for _ in range(COMMIT_ATTEMPTS):
        found = registered(table)
        if found is not None:
            return Registration(target.table, found, False, files), None
        if check_files is not None:
            check_files()
            check_files = None
        check_unpartitioned(table)
        prepared = prepare(table)
        if before_commit is not None:
            before_commit()
        try:
            with _quiet_statistics(), table.transaction() as tx:     # the files and the record: one commit
                write(tx, prepared)
                tx.set_properties({registration_property(key, base): redact(base)})
        except CommitFailedException as e:      # another commit came first: reread, then decide again
            logger.warning("%s: %s; retrying", target.table, e)
            conflict = e
            table = catalog.load_table(target.table)
            continue
        return Registration(target.table, table.current_snapshot().snapshot_id, True, files), prepared
    raise RuntimeError(f"--iceberg-table {target.table}: every commit conflicted with another; rerun the same "
                       "command") from conflict


def _iceberg_schema(schema: pa.Schema):
    """The Iceberg schema pyiceberg's create_table makes of an Arrow schema (fresh field ids)."""
    from pyiceberg.catalog import Catalog
    return Catalog._convert_schema_if_needed(schema)  # noqa: SLF001 - the conversion create_table uses


def _current_files(table, keep) -> list[str]:
    """Paths of the current snapshot's data files for which keep(path) is true."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return []
    from pyiceberg.manifest import ManifestContent
    out = []
    for m in snapshot.manifests(table.io):
        if m.content == ManifestContent.DATA:
            out += [e.data_file.file_path for e in m.fetch_manifest_entry(table.io, discard_deleted=True)
                    if keep(e.data_file.file_path)]
    return out


def _marked(table, base: str) -> list:
    """Snapshots of the table's history that registered the output at `base`."""
    return [s for s in table.snapshots() if (s.summary.additional_properties if s.summary else {})
            .get(OUTPUT_PROPERTY) == redact(base)]


def registration_property(key: str, base: str) -> str:
    """The table property that records the registration of run `key`'s output at `base` (its value: the URL)."""
    return f"{REGISTERED_PREFIX}{key}.{hashlib.sha256(redact(base).encode()).hexdigest()[:16]}"


def check_unpartitioned(table) -> None:
    """ValueError for a partitioned table: add_files cannot give the output's files partition values."""
    spec = table.spec()
    if not spec.is_unpartitioned():
        raise ValueError(f"--iceberg-table {'.'.join(table.name())} is partitioned ({spec}); the output's Parquet "
                         "files are added as they are, without partition values: name an unpartitioned table, "
                         "or a new one (created unpartitioned)")


def find_registration(table, base: str, key: str, files: list[str]) -> int | None:
    """The snapshot id that registered these files of the output at `base` (the current snapshot when only the
    table property of the registration says so: its snapshot rewritten or expired since), or None when they
    are not in the table. RuntimeError when the current snapshot holds some of them but not all (not our
    doing)."""
    snapshot = table.current_snapshot()
    if snapshot is not None and table.properties.get(registration_property(key, base)) == redact(base):
        marked = [s.snapshot_id for s in _marked(table, base)
                  if s.summary.additional_properties.get(RUN_KEY_PROPERTY) == key]
        return marked[-1] if marked else snapshot.snapshot_id
    for s in _marked(table, base):
        if s.summary.additional_properties.get(RUN_KEY_PROPERTY) == key:
            return s.snapshot_id
    wanted = set(files)
    present = set(_current_files(table, wanted.__contains__))
    if present == wanted:          # registered, its snapshot since expired (or added by hand)
        return table.current_snapshot().snapshot_id
    if present:
        raise RuntimeError(f"Iceberg table {'.'.join(table.name())}: {len(present)} of the {len(files)} Parquet shards of "
                           f"{base} are in the table already, the others not; remove them from the table and rerun")
    return None


def check_table_file(io, path: str, size: int | None) -> None:
    """NotTheRecordedFile unless the file at `path` (a URL of the table's file I/O `io`) is a regular file of `size`
    bytes (any size when None), found by a stat (or a HEAD on object stores), nothing read: a FIFO or a device put
    there is never opened (a read would block for good or never end)."""
    if is_local_url(path):
        fs, local = url_fs(path)
        check_recorded(fs, local, {"bytes": fs.size(local) if size is None else size}, digest=False)
    elif size is not None and (got := len(io.new_input(path))) != size:
        raise NotTheRecordedFile(f"{path}: {got} bytes, {size} recorded")


def check_table_files(table, tasks) -> list:
    """The scan `tasks` (pyiceberg FileScanTasks), once each data file and delete file they read is a regular file of
    the size the table records of it (file_size_in_bytes: a stat, or a HEAD on object stores; nothing read);
    TableFileChanged naming the first that is not (replaced, cut short, a FIFO or a device put there)."""
    tasks = list(tasks)
    for task in tasks:
        for f in (task.file, *task.delete_files):
            try:
                check_table_file(table.io, f.file_path, f.file_size_in_bytes)
            except (NotTheRecordedFile, FileNotFoundError) as e:
                raise TableFileChanged(
                    f"Iceberg table {'.'.join(table.name())}: a file it references is not the one it recorded "
                    f"({redact(str(e))}): changed or replaced since it was added; nothing was committed. Put the "
                    "file back, or remove it from the table") from None
    return tasks


def run_ids(io, files: list[str]) -> pa.Array:
    """The distinct ids of an output's Parquet shards (their `id` column alone is read), as a string array."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    columns = []
    for f in files:
        with io.new_input(f).open() as stream:
            columns += pq.ParquetFile(stream).read(columns=[ID_COLUMN]).column(0).chunks
    return pc.unique(pa.chunked_array(columns, pa.string()))


def check_new_ids(table, ids: pa.Array, base: str, replaced: pa.Array | None = None) -> None:
    """DuplicateIdError when the table's current snapshot holds any of `ids` (those of the output at `base`),
    but for the rows of the documents `replaced` (--iceberg-mode upsert: deleted in the same commit; a sentence
    id is "<document id>#<index>").

    Cost: the table's manifests, then the `id` column alone of the data files whose id bounds overlap
    [min(ids), max(ids)], streamed batch by batch against `ids` (held in memory). With the default ids of
    --iceberg-table (each file's full path) another partition's files fall outside that range and are not
    read, in tables created with full id bounds (ID_METRICS_PROPERTY); with --id-field values spread over
    the whole range, every file's `id` column is read."""
    if table.current_snapshot() is None or len(ids) == 0:
        return
    import pyarrow.compute as pc
    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThanOrEqual
    low, high = (v.as_py() for v in pc.min_max(ids).values())
    scan = table.scan(row_filter=And(GreaterThanOrEqual(ID_COLUMN, low), LessThanOrEqual(ID_COLUMN, high)),
                      selected_fields=(ID_COLUMN,))
    check_table_files(table, scan.plan_files())      # before any is opened
    held = [pc.unique(c.filter(pc.is_in(c, value_set=ids))) for c in
            (batch.column(0) for batch in scan.to_arrow_batch_reader())]
    held = pc.unique(pa.chunked_array(held)) if held else pa.array([], pa.string())
    if replaced is not None and len(held):
        docs = pc.replace_substring_regex(held, pattern="#[^#]*$", replacement="")
        held = held.filter(pc.invert(pc.is_in(docs, value_set=replaced.cast(pa.string()))))
    if len(held):
        examples = pc.array_take(held, pc.array_sort_indices(held)[:3]).to_pylist()
        raise DuplicateIdError(
            f"Iceberg table {'.'.join(table.name())} already holds {len(held)} of the {len(ids)} ids of {base} "
            f"(e.g. {', '.join(map(repr, examples))}): nothing was added, ids must be unique in the table. "
            "Give each output ids of its own (the default ids of --iceberg-table name each file by its full path; "
            "or --id-root, or unique --id-field values), or remove those rows from the table")


def registrations_under(table, base: str) -> list[int]:
    """Ids of snapshots that registered files under the output at `base` (history markers, or the current
    snapshot when it references files there). A local folder is matched by its resolved path: registered through
    a symbolic link to it (or through it, as a link), it is the same folder."""
    resolved = functools.lru_cache(maxsize=None)(_resolved)     # a folder's files: one resolution
    real = resolved(base)
    ids = [s.snapshot_id for s in table.snapshots()
           if resolved((s.summary.additional_properties if s.summary else {}).get(OUTPUT_PROPERTY) or "") == real]
    if not ids and _current_files(table, lambda p: p.startswith(base + "/") or
                                  resolved(posixpath.dirname(p)).startswith(real + "/")):
        ids = [table.current_snapshot().snapshot_id]
    return ids


def _resolved(url: str) -> str:
    """A file:// URL with the symbolic links of its path resolved; any other URL as it is."""
    return "file://" + os.path.realpath(url[len("file://"):]) if url.startswith("file://") else url


def registered_outputs(table) -> list[str]:
    """URLs of the outputs registered in the table (their registration properties: registration_property) that its
    current snapshot references files of, in the order they were registered (history markers; unmarked last)."""
    urls = {v for k, v in table.properties.items() if k.startswith(REGISTERED_PREFIX)}
    live = set()
    for path in _current_files(table, lambda _: True):
        path = redact(path)
        while "/" in path and path not in urls:      # the folders above a data file, deepest first
            path = path.rsplit("/", 1)[0]
        live.add(path)
    order = {}
    for k, s in enumerate(table.snapshots()):
        order.setdefault((s.summary.additional_properties if s.summary else {}).get(OUTPUT_PROPERTY), k)
    return sorted((u for u in urls if u in live), key=lambda u: (order.get(u, len(order)), u))


class _quiet_statistics:
    """pyiceberg warns once per vector column and file that it has no statistics (we write none on vectors,
    on purpose: formats/parquet.py); those warnings are dropped while files are added."""

    class _Drop(logging.Filter):
        def filter(self, record):
            return "statistics missing" not in record.getMessage()

    def __enter__(self):
        self.logger, self.f = logging.getLogger("pyiceberg.io.pyarrow"), self._Drop()
        self.logger.addFilter(self.f)

    def __exit__(self, *exc):
        self.logger.removeFilter(self.f)


def data_files(tx, files: list[str], io) -> list:
    """pyiceberg's DataFiles of Parquet files added as they are (as add_files makes them)."""
    from pyiceberg.table import _parquet_files_to_data_files
    return list(_parquet_files_to_data_files(tx.table_metadata, files, io))


def add_snapshot(tx, io, files: list[str], props: dict, overwrite: bool = False, deletes=()) -> None:
    """One snapshot in transaction `tx` adding the Parquet `files` as they are (add_files' name mapping and DataFiles)
    and the position-delete files `deletes`, with summary `props`, by _upsert_producer: never rebased on a head
    another writer moved meanwhile (append and upsert alike: their checks ran against the head they read)."""
    from pyiceberg.table import TableProperties
    from pyiceberg.table.snapshots import Operation
    if tx.table_metadata.name_mapping() is None:     # as add_files: our shards have no field ids
        tx.set_properties({TableProperties.DEFAULT_NAME_MAPPING: tx.table_metadata.schema().name_mapping.model_dump_json()})
    with _upsert_producer()(operation=Operation.OVERWRITE if overwrite else Operation.APPEND, transaction=tx, io=io,
                            snapshot_properties=props) as producer:
        for data_file in data_files(tx, files, io):
            producer.append_data_file(data_file)
        for d in deletes:
            producer.append_delete_file(d)


def _upsert_producer():
    """pyiceberg's fast-append snapshot producer that also commits position-delete files: they go into a
    manifest of content DELETES (pyiceberg 0.12 writes only data manifests) and into the snapshot summary. It
    is never rebased: pyiceberg retries a conflicting commit on top of the new head, which would apply deletes
    and rows computed against another state, or add ids another writer's commit added meanwhile past the check
    of held ids (check_new_ids); a moved head is a CommitFailedException instead (commit() rereads and checks
    again)."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.manifest import ManifestContent, ManifestEntry, ManifestEntryStatus, ManifestWriterV2
    from pyiceberg.table.update.snapshot import _FastAppendFiles

    class DeleteManifestWriter(ManifestWriterV2):
        def content(self):
            return ManifestContent.DELETES

        @property
        def _meta(self):
            return {**super()._meta, "content": "deletes"}

    class UpsertFiles(_FastAppendFiles):
        def _validate_concurrency(self) -> None:
            if self._commit_window is not None and not self._commit_window.is_empty():
                raise CommitFailedException("the table moved since this commit read it")

        def append_delete_file(self, delete_file) -> None:
            self.__dict__.setdefault("added_deletes", []).append(delete_file)

        def _manifests(self):
            out = super()._manifests()
            deletes = self.__dict__.get("added_deletes", [])
            if deletes:
                md = self._transaction.table_metadata
                with DeleteManifestWriter(md.spec(), self.schema(), self.new_manifest_output(), self._snapshot_id,
                                          self._compression) as writer:
                    for d in deletes:
                        writer.add(ManifestEntry.from_args(
                            status=ManifestEntryStatus.ADDED, snapshot_id=self._snapshot_id, sequence_number=None,
                            file_sequence_number=None, data_file=d))
                out = [writer.to_manifest_file()] + out
            return out

        def _summary(self, snapshot_properties=None):
            data = self._added_data_files           # the summary counts what _added_data_files holds
            self._added_data_files = data + self.__dict__.get("added_deletes", [])
            try:
                return super()._summary(snapshot_properties or {})
            finally:
                self._added_data_files = data

    return UpsertFiles
