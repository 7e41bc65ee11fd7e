"""Helpers of the upsert tests and benchmarks/incremental.py: one day's flags, and a table's live rows compared with
a full run's shards."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from elmo_pipeline.formats.iceberg import IcebergTarget, data_file_urls


def upsert_argv(input_glob: str, output: str, table: str, catalog: str, delete_missing: bool = True,
                id_field: str = "id") -> list[str]:
    """The flags of one day of a change-only run into `table` (what a benchmark times): JSONL input with stable
    ids in `id_field`, Parquet only; the model and the other flags are the caller's."""
    return ["--input", input_glob, "--input-format", "jsonl", "--id-field", id_field, "--output", output,
            "--format", "parquet", "--iceberg-table", table, "--iceberg-catalog", catalog, "--iceberg-mode", "upsert",
            *(["--delete-missing"] if delete_missing else [])]


def table_rows(target: IcebergTarget, columns: tuple[str, ...] | None = None,
               snapshot_id: int | None = None) -> pa.Table:
    """The table's live rows (at `snapshot_id`, default the current one) as pyiceberg's scan reads them
    (position deletes applied), sorted by id (_in_order): what a comparison with a full rebuild takes."""
    table = target._load_table(target.load_catalog(read_only=True))      # noqa: SLF001
    scan = table.scan(selected_fields=columns or ("*",), snapshot_id=snapshot_id)
    return _in_order(scan.to_arrow())


def _in_order(rows: pa.Table) -> pa.Table:
    """Rows sorted by id (and token_index: --parquet-layout token has a row per token)."""
    keys = [k for k in ("id", "token_index") if k in rows.column_names]
    return rows.sort_by([(k, "ascending") for k in keys]) if rows.num_rows else rows


def same_rows(target: IcebergTarget, output: str, snapshot_id: int | None = None) -> bool:
    """Whether the table's live rows (table_rows) equal the Parquet shards of the finished local output folder
    `output` (a full run: its manifest's shards), row for row by id, value for value (vectors bit for bit; the shards'
    fixed-size lists compared as the table's plain lists)."""
    with open(os.path.join(output, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    got = table_rows(target, snapshot_id=snapshot_id)
    parts = [pq.read_table(u[len("file://"):]) for u in data_file_urls(output, manifest)]
    want = _in_order(pa.concat_tables(parts)) if parts else None
    if want is None or not want.num_rows:
        return got.num_rows == 0
    return got.num_rows == want.num_rows and got.equals(want.cast(got.schema))
