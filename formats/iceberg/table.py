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

import functools
import logging
import os
from dataclasses import dataclass
from urllib.parse import quote

import pyarrow as pa

from elmo_pipeline.formats.iceberg.commit import (FILES_PROPERTY, ID_COLUMN, OUTPUT_PROPERTY, RUN_KEY_PROPERTY,
                                                  Registration, _iceberg_schema, add_snapshot, check_new_ids, check_unpartitioned, commit,
                                                  find_registration, registered_outputs, registrations_under, run_ids)
from elmo_pipeline.fsio import redact

INSTALL = "pip install 'elmo-pipeline[iceberg]'"
SCHEMA_PROPERTY = "elmo-pipeline.arrow-schema"
MANIFEST_ENTRY = "iceberg"                           # manifest.json: [{"table", "catalog"}] registered later
# a new table keeps the full min/max of `id` per data file in its manifests (pyiceberg truncates to 16
# characters by default): check_new_ids() then skips, unread, the files whose ids cannot overlap a run's
ID_METRICS_PROPERTY = f"write.metadata.metrics.column.{ID_COLUMN}"
# pyiceberg's default catalog name: a SQL catalog keeps each table under a catalog name, and readers see it
# with load_catalog("default", uri=...) (Spark's JDBC catalog: a catalog named default)
CATALOG_NAME = "default"
logger = logging.getLogger("elmo-pipeline.iceberg")


class IcebergUnavailable(RuntimeError):
    """--iceberg-table without pyiceberg installed."""


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
        if catalog.startswith("sqlite:") and ":memory:" in catalog:
            raise ValueError("--iceberg-catalog sqlite:///:memory: is a catalog in this process's memory, gone when "
                             "the run ends with the table it registered: name a database file (sqlite:///path.db)")
        if "parquet" not in formats:
            raise ValueError("--iceberg-table registers the Parquet shards: --format must include parquet")
        if dtype == "float16":
            raise ValueError("--iceberg-table needs --dtype float32 (Iceberg has no 16-bit float type)")
        if warehouse and (any(c in warehouse.split("://", 1)[-1] for c in "?#") or redact(warehouse) != warehouse):
            # pyiceberg's file I/O drops a query or fragment: every metadata file of the table would be written to
            # the one path before it, over each other (and over a file there), and the URL kept in the catalog
            raise ValueError(f"--iceberg-warehouse {redact(warehouse)} holds a query, a fragment or user info, which "
                             "a table's location cannot carry (its files would all be written to one path, and a "
                             "credential kept in the catalog): name a plain folder URL; credentials go in the "
                             "storage options or PYICEBERG_CATALOG__DEFAULT__* settings")
        import_pyiceberg()
        return cls(table, catalog, warehouse)

    def properties(self, storage_options: dict | None = None) -> dict:
        """pyiceberg catalog properties: uri, warehouse, and the S3 settings of the output's storage options."""
        props = {"uri": self.catalog}
        warehouse = self.warehouse
        if warehouse is None and self.sqlite_path():       # the database file's folder (its URI's query left out)
            warehouse = "file://" + os.path.dirname(self.sqlite_path())
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
                 storage_options: dict | None = None, before_commit=None, check_files=None) -> Registration:
        """Add the Parquet shards of a finished output (its manifest) to the table in one snapshot, unless the
        table already has them (see the module docstring). Creates the table from `schema` (default: the first
        shard's) when absent. before_commit(), when given, runs once every check has passed, just before the
        files are added (the output records the table there: recorded_tables); check_files(), when given, runs once
        the table is found not to hold the output, before any of its files is read (commit())."""
        files = data_file_urls(output, manifest)
        if not files:
            return Registration(self.table, None, False, 0)
        catalog = self.load_catalog(storage_options)
        if schema is None:
            import pyarrow.parquet as pq
            from pyiceberg.io import load_file_io
            with load_file_io(catalog.properties, files[0]).new_input(files[0]).open() as f:
                schema = pq.read_schema(f)
        table = self._table_or_create(catalog, schema)
        key, base = str((manifest.get("run") or {}).get("key")), output_url(output)
        ids = functools.cache(lambda: run_ids(table.io, files))     # read once, after the first "registered?"

        def prepare(table):
            check_new_ids(table, ids(), base)

        def write(tx, _):
            add_snapshot(tx, table.io, files, {OUTPUT_PROPERTY: redact(base), RUN_KEY_PROPERTY: key,
                                               FILES_PROPERTY: str(len(files))})
        registration, _ = commit(self, catalog, table, base, key, len(files),
                                 lambda t: find_registration(t, base, key, files), prepare, write, before_commit,
                                 check_files)
        return registration


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


def recorded_tables(manifest: dict | None) -> list[dict]:
    """The tables an output was registered in, as its manifest records them: {"table", "catalog"} of its own
    command's --iceberg-table (options), then those of the commands that registered it once finished."""
    manifest = manifest or {}
    options = manifest.get("options") or {}
    own = [{"table": options["iceberg_table"], "catalog": options.get("iceberg_catalog")}] \
        if options.get("iceberg_table") else []
    return own + [e for e in manifest.get(MANIFEST_ENTRY, []) if isinstance(e, dict) and e.get("table")]


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
