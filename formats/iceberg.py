"""An output's Parquet shards registered in an Apache Iceberg table (--iceberg-table). No Beam import.

pyiceberg is an optional extra (pip install 'elmo-pipeline[iceberg]'), imported only when a table is named.
The shards are added as they are (pyiceberg's add_files: no rewrite; the table points at the output's final
Parquet paths), all of one output in one append snapshot whose summary carries the output URL (redacted:
fsio/redact.py) and the run key (elmo-pipeline.output, elmo-pipeline.run-key). Finalize calls register() after every file is in place
and before _SUCCESS (output/finalize.py), and again on every rerun that finishes or finds the output, so
register() is idempotent: an output already registered (a table property keyed by its run key and URL, set
in the commit that adds the files: it outlives rewrites of the data and snapshot expiry; or a snapshot of
the table's history with its URL and run key, or its files all referenced by the current snapshot) is not
added again; an output with an id the
table holds already is not added at all (DuplicateIdError: check_new_ids, before each commit). Two
registrations racing are settled by the catalog's optimistic commit (the loser rereads and decides again).

A table that does not exist is created (its namespace too) from the run's shard schema; Iceberg has no
fixed-size lists, so vectors read back as plain lists, and the shard schema with its widths is kept in the
table property elmo-pipeline.arrow-schema: a later run whose shards differ (another model, --layers,
--parquet-layout) is refused before it starts, and so is a partitioned table (added files carry no partition
values). Checking a table reads only: a SQLite catalog that does not exist yet is not created.

An output knows the tables it was registered in (recorded_tables: its manifest's options, and the "iceberg"
entries added when a finished output is registered by a later command): --overwrite of it is refused unless
the same table is named and no longer references files under the output (check_overwrite).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from urllib.parse import quote

import pyarrow as pa

from elmo_pipeline.fsio import redact

INSTALL = "pip install 'elmo-pipeline[iceberg]'"
OUTPUT_PROPERTY, RUN_KEY_PROPERTY, FILES_PROPERTY = "elmo-pipeline.output", "elmo-pipeline.run-key", "elmo-pipeline.files"
SCHEMA_PROPERTY = "elmo-pipeline.arrow-schema"
REGISTERED_PREFIX = "elmo-pipeline.registered."      # + run key + "." + hash of the output URL -> the output URL
MANIFEST_ENTRY = "iceberg"                           # manifest.json: [{"table", "catalog"}] registered later
ID_COLUMN = "id"
# a new table keeps the full min/max of `id` per data file in its manifests (pyiceberg truncates to 16
# characters by default): check_new_ids() then skips, unread, the files whose ids cannot overlap a run's
ID_METRICS_PROPERTY = f"write.metadata.metrics.column.{ID_COLUMN}"
# pyiceberg's default catalog name: a SQL catalog keeps each table under a catalog name, and readers see it
# with load_catalog("default", uri=...) (Spark's JDBC catalog: a catalog named default)
CATALOG_NAME = "default"
logger = logging.getLogger("elmo-pipeline.iceberg")


class IcebergUnavailable(RuntimeError):
    """--iceberg-table without pyiceberg installed."""


class DuplicateIdError(ValueError):
    """A registration that would add ids the table holds already (pipeline/exits.py: DATA, exit 65)."""


def import_pyiceberg():
    try:
        import pyiceberg.catalog  # noqa: F401
        import pyiceberg.io.pyarrow  # noqa: F401
    except ImportError as e:
        raise IcebergUnavailable(f"--iceberg-table needs pyiceberg, which is not installed ({e}): {INSTALL}") from None
    import pyiceberg
    return pyiceberg


def output_url(output: str) -> str:
    """The URL the table records for an output folder: file:///abs/path for local paths, the URL otherwise."""
    if "://" in output and not output.startswith("file://"):
        return output.rstrip("/")
    path = output[len("file://"):] if output.startswith("file://") else output
    return "file://" + os.path.abspath(path)


def data_file_urls(output: str, manifest: dict) -> list[str]:
    """The output's Parquet shards, as the table references them, from its manifest."""
    base = output_url(output)
    return [f"{base}/{s['parquet']}" for s in manifest.get("shards", []) if "parquet" in s]


def _field_types(schema) -> list[tuple[str, str]]:
    """(name, Iceberg type) of an Iceberg schema's top-level fields: what two schemas must share (not ids)."""
    return [(f.name, str(f.field_type)) for f in schema.fields]


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


@dataclass(frozen=True)
class IcebergTarget:
    """--iceberg-table NS.TABLE in the catalog at --iceberg-catalog URI (pyiceberg infers its kind from the
    URI: sqlite:// and postgresql:// a SQL catalog, http(s):// a REST catalog, thrift:// Hive); new tables'
    metadata under --iceberg-warehouse (default: for sqlite:///, the folder of the database file)."""
    table: str
    catalog: str
    warehouse: str | None = None

    @classmethod
    def from_flags(cls, table: str | None, catalog: str | None, warehouse: str | None, formats: list[str],
                   dtype: str) -> "IcebergTarget | None":
        """The target of the command line's flags (None without --iceberg-table); ValueError for flags that
        do not go together, IcebergUnavailable without pyiceberg. Touches nothing."""
        if not table:
            if catalog or warehouse:
                raise ValueError("--iceberg-catalog and --iceberg-warehouse need --iceberg-table NS.TABLE")
            return None
        if "." not in table.strip(".") or any(not p for p in table.split(".")):
            raise ValueError(f"--iceberg-table takes NAMESPACE.TABLE, got {table!r}")
        if not catalog:
            raise ValueError("--iceberg-table needs --iceberg-catalog URI (e.g. sqlite:///path/catalog.db)")
        if "parquet" not in formats:
            raise ValueError("--iceberg-table registers the Parquet shards: --format must include parquet")
        if dtype == "float16":
            raise ValueError("--iceberg-table needs --dtype float32 (Iceberg has no 16-bit float type)")
        import_pyiceberg()
        return cls(table, catalog, warehouse)

    def properties(self, storage_options: dict | None = None) -> dict:
        """pyiceberg catalog properties: uri, warehouse, and the S3 settings of the output's storage options."""
        props = {"uri": self.catalog}
        warehouse = self.warehouse
        if warehouse is None and self.catalog.startswith("sqlite:///") and ":memory:" not in self.catalog:
            warehouse = "file://" + os.path.dirname(os.path.abspath(self.catalog[len("sqlite:///"):]))
        if warehouse:
            props["warehouse"] = warehouse
        s3 = (storage_options or {}).get("s3", {})
        for ours, theirs in (("endpoint_url", "s3.endpoint"), ("key", "s3.access-key-id"),
                             ("secret", "s3.secret-access-key")):
            if s3.get(ours):
                props[theirs] = s3[ours]
        if (s3.get("client_kwargs") or {}).get("region_name"):
            props["s3.region"] = s3["client_kwargs"]["region_name"]
        return props

    def sqlite_path(self) -> str | None:
        """The database file of a sqlite:/// catalog (absolute), else None."""
        if self.catalog.startswith("sqlite:///") and ":memory:" not in self.catalog:
            return os.path.abspath(self.catalog[len("sqlite:///"):].split("?", 1)[0])
        return None

    def check_outside(self, output: str) -> None:
        """ValueError when the SQLite catalog or the table's warehouse lies inside --output (a local folder):
        the run would take them for files in its way, and --overwrite would leave the table without them."""
        if "://" in output and not output.startswith("file://"):
            return
        out = os.path.realpath(output[len("file://"):] if output.startswith("file://") else output)
        warehouse = self.properties().get("warehouse", "")
        for what, path in (("--iceberg-catalog", self.sqlite_path()),
                           ("--iceberg-warehouse", warehouse[len("file://"):] if warehouse.startswith("file://")
                            else None if "://" in warehouse else warehouse)):
            if path and (os.path.realpath(path) + "/").startswith(out + "/"):
                raise ValueError(f"{what} {path} lies inside --output {output}: keep the catalog and the table's "
                                 "warehouse outside the output folder")

    def load_catalog(self, storage_options: dict | None = None, read_only: bool = False):
        """The catalog (pyiceberg's load_catalog); a SQLite database's folder is created when missing, unless
        `read_only` (then a SQL catalog's tables are not created and SQLite opens the file read-only).
        RuntimeError naming the URI (password hidden) when it cannot be opened."""
        import_pyiceberg()
        from pyiceberg.catalog import load_catalog
        props = self.properties(storage_options)
        path = self.sqlite_path()
        if read_only:
            props["init_catalog_tables"] = "false"
            if path:
                # quoted twice: SQLAlchemy's URL unquotes once, SQLite's URI filename once more
                props["uri"] = f"sqlite:///file:{quote(quote(path))}?mode=ro&uri=true"
        elif path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            return load_catalog(CATALOG_NAME, **props)
        except Exception as e:  # noqa: BLE001 - drivers raise their own kinds (sqlalchemy, requests, ...)
            raise RuntimeError(redact(f"--iceberg-catalog {self.catalog} cannot be opened: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")) from None

    def _load_table(self, catalog):
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
        try:
            return catalog.load_table(self.table)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

    def _table_or_create(self, catalog, schema: pa.Schema):
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, TableAlreadyExistsError
        table = self._load_table(catalog)
        if table is not None:
            return table
        namespace = self.table.rsplit(".", 1)[0]
        try:
            catalog.create_namespace(namespace)
        except NamespaceAlreadyExistsError:
            pass
        try:
            return catalog.create_table(self.table, schema=schema, properties={SCHEMA_PROPERTY: schema.to_string(),
                                                                               ID_METRICS_PROPERTY: "full"})
        except TableAlreadyExistsError:       # created meanwhile by a run racing this one
            return catalog.load_table(self.table)

    def check(self, schema: pa.Schema, output: str, storage_options: dict | None = None) -> list[int]:
        """Before a run, reading only: the catalog answers (a SQLite file not there yet is a new catalog), and
        the table, when it exists, takes shards of `schema` (ValueError naming the difference otherwise).
        Returns the ids of snapshots that hold files under `output` (from the table's history, or the current
        snapshot's files), for the caller's --overwrite rule."""
        path = self.sqlite_path()
        if path and not os.path.exists(path):
            return []
        catalog = self.load_catalog(storage_options, read_only=True)
        table = self._load_table(catalog)
        if table is None:
            return []
        check_unpartitioned(table)
        recorded = table.properties.get(SCHEMA_PROPERTY)
        if recorded is not None and recorded != schema.to_string():
            raise ValueError(f"--iceberg-table {self.table} holds shards of another schema than this run's "
                             f"(another model, --layers, --parquet-layout or --duplicate-layer0?): "
                             f"{_schema_difference(recorded, schema.to_string())}")
        ours = _field_types(_iceberg_schema(schema))
        if _field_types(table.schema()) != ours:
            raise ValueError(f"--iceberg-table {self.table} has the schema {_field_types(table.schema())}, this run's "
                             f"shards {ours}")
        return registrations_under(table, output_url(output))

    def registered_outputs(self, storage_options: dict | None = None) -> list[str]:
        """registered_outputs() of the table, reading only ([] when there is no table yet)."""
        path = self.sqlite_path()
        if path and not os.path.exists(path):
            return []
        table = self._load_table(self.load_catalog(storage_options, read_only=True))
        return [] if table is None else registered_outputs(table)

    def register(self, output: str, manifest: dict, schema: pa.Schema | None = None,
                 storage_options: dict | None = None, before_commit=None) -> Registration:
        """Add the Parquet shards of a finished output (its manifest) to the table in one snapshot, unless the
        table already has them (see the module docstring). Creates the table from `schema` (default: the first
        shard's) when absent. before_commit(), when given, runs once every check has passed, just before the
        files are added (the output records the table there: recorded_tables)."""
        files = data_file_urls(output, manifest)
        if not files:
            return Registration(self.table, None, False, 0)
        from pyiceberg.exceptions import CommitFailedException
        catalog = self.load_catalog(storage_options)
        if schema is None:
            import pyarrow.parquet as pq
            from pyiceberg.io import load_file_io
            with load_file_io(catalog.properties, files[0]).new_input(files[0]).open() as f:
                schema = pq.read_schema(f)
        table = self._table_or_create(catalog, schema)
        key = str((manifest.get("run") or {}).get("key"))
        base = output_url(output)
        conflict, ids = None, None
        for _ in range(5):
            found = find_registration(table, base, key, files)
            if found is not None:
                return Registration(self.table, found, False, len(files))
            check_unpartitioned(table)
            ids = run_ids(table.io, files) if ids is None else ids
            check_new_ids(table, ids, base)
            if before_commit is not None:
                before_commit()
            try:
                with _quiet_statistics(), table.transaction() as tx:     # the files and the record: one commit
                    tx.add_files(files, snapshot_properties={OUTPUT_PROPERTY: redact(base), RUN_KEY_PROPERTY: key,
                                                             FILES_PROPERTY: str(len(files))})
                    tx.set_properties({registration_property(key, base): redact(base)})
            except CommitFailedException as e:      # another commit came first: reread, then decide again
                logger.warning("%s: %s; retrying", self.table, e)
                conflict = e
                table = catalog.load_table(self.table)
                continue
            return Registration(self.table, table.current_snapshot().snapshot_id, True, len(files))
        # chained to the conflict: a retry-later failure (pipeline/exits.py: 75)
        raise RuntimeError(f"--iceberg-table {self.table}: every commit conflicted with another; rerun the same "
                           "command") from conflict


def _columns(schema_text: str) -> dict[str, str]:
    """{column: type} of an Arrow schema's text (its top-level lines)."""
    return dict(line.split(": ", 1) for line in schema_text.splitlines() if line and not line.startswith(" "))


def _schema_difference(table_text: str, run_text: str) -> str:
    """The columns that differ between the table's recorded shard schema and this run's, in a few words."""
    a, b = _columns(table_text), _columns(run_text)
    parts = [f"{c}: {a[c]} in the table, {b[c]} here" for c in a if c in b and a[c] != b[c]]
    if set(a) - set(b):
        parts.append(f"only in the table: {', '.join(c for c in a if c not in b)}")
    if set(b) - set(a):
        parts.append(f"only in this run: {', '.join(c for c in b if c not in a)}")
    return "; ".join(parts) or "the column order differs"


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


def run_ids(io, files: list[str]) -> pa.Array:
    """The distinct ids of an output's Parquet shards (their `id` column alone is read), as a string array."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    columns = []
    for f in files:
        with io.new_input(f).open() as stream:
            columns += pq.ParquetFile(stream).read(columns=[ID_COLUMN]).column(0).chunks
    return pc.unique(pa.chunked_array(columns, pa.string()))


def check_new_ids(table, ids: pa.Array, base: str) -> None:
    """DuplicateIdError when the table's current snapshot holds any of `ids` (those of the output at `base`).

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
    held = [pc.unique(c.filter(pc.is_in(c, value_set=ids))) for c in
            (batch.column(0) for batch in scan.to_arrow_batch_reader())]
    held = pc.unique(pa.chunked_array(held)) if held else []
    if len(held):
        examples = pc.array_take(held, pc.array_sort_indices(held)[:3]).to_pylist()
        raise DuplicateIdError(
            f"Iceberg table {'.'.join(table.name())} already holds {len(held)} of the {len(ids)} ids of {base} "
            f"(e.g. {', '.join(map(repr, examples))}): nothing was added, ids must be unique in the table. "
            "Give each output ids of its own (the default ids of --iceberg-table name each file by its full path; "
            "or --id-root, or unique --id-field values), or remove those rows from the table")


def registrations_under(table, base: str) -> list[int]:
    """Ids of snapshots that registered files under the output at `base` (history markers, or the current
    snapshot when it references files there)."""
    ids = [s.snapshot_id for s in _marked(table, base)]
    if not ids and _current_files(table, lambda p: p.startswith(base + "/")):
        ids = [table.current_snapshot().snapshot_id]
    return ids


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


def recorded_tables(manifest: dict | None) -> list[dict]:
    """The tables an output was registered in, as its manifest records them: {"table", "catalog"} of its own
    command's --iceberg-table (options), then those of the commands that registered it once finished."""
    manifest = manifest or {}
    options = manifest.get("options") or {}
    own = [{"table": options["iceberg_table"], "catalog": options.get("iceberg_catalog")}] \
        if options.get("iceberg_table") else []
    return own + [e for e in manifest.get(MANIFEST_ENTRY, []) if isinstance(e, dict) and e.get("table")]


def record_table(manifest: dict, target: IcebergTarget) -> bool:
    """Add `target` to the manifest's tables (recorded_tables) unless there; True when it was added."""
    if any((e["table"], e["catalog"]) == (target.table, redact(target.catalog)) for e in recorded_tables(manifest)):
        return False
    manifest.setdefault(MANIFEST_ENTRY, []).append({"table": target.table, "catalog": redact(target.catalog)})
    return True


def check_overwrite(output: str, manifest: dict | None, target: IcebergTarget | None) -> None:
    """ValueError for --overwrite of an output registered in a table (recorded_tables) that this command does
    not name: the table would point at replaced files. (With the table named, IcebergTarget.check says
    whether it still references files under the output.)"""
    others = [e for e in recorded_tables(manifest) if target is None or
              (e["table"], e["catalog"]) != (target.table, redact(target.catalog))]
    if others:
        e = others[0]
        raise ValueError(f"--overwrite of {output}: its Parquet files were registered in Iceberg table {e['table']} "
                         f"(catalog {redact(str(e['catalog']))}), which would then point at replaced files. Remove "
                         f"them from that table, then rerun with --iceberg-table {e['table']} --iceberg-catalog "
                         "<its catalog>, or write to a new --output")


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
