"""The Iceberg table is part of an output's commit: an output registered in a table knows it (its manifest), so
--overwrite without that table is refused; a partitioned table is refused while planning; a registration is
recognised by the table property it set, through rewrites of the table's data and snapshot expiry; and
planning (`plan`, --dry-run) writes nothing, no catalog either. Real pyiceberg on SQLite, read back with
pyiceberg and duckdb."""
import json
import os

import pyarrow.parquet as pq
import pytest

from elmo_pipeline.pipeline.cli import main as cli_main
from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv, write_corpus

pyiceberg = pytest.importorskip("pyiceberg")
duckdb = pytest.importorskip("duckdb")
from pyiceberg.catalog import load_catalog  # noqa: E402

from elmo_pipeline.formats.iceberg import data_file_urls  # noqa: E402

TABLE = "elmo.vectors"
SMALL = ("--shard-sentences", "5", "--max-tokens-per-batch", "256")


def ice(wh, uri=None):
    return ("--iceberg-table", TABLE, "--iceberg-catalog", uri or f"sqlite:///{wh}/catalog.db")


def catalog_of(wh):
    return load_catalog("default", uri=f"sqlite:///{wh}/catalog.db", warehouse=f"file://{wh}")


def parquet_rows(out):
    """(id, layer_0) of the output's Parquet files, as duckdb reads them, by id."""
    m = json.load(open(os.path.join(out, "manifest.json")))
    files = [f[len("file://"):] for f in data_file_urls(out, m)]
    return duckdb.sql(f"SELECT id, layer_0 FROM read_parquet({files!r}) ORDER BY id").fetchall()


def table_rows(table):
    return sorted(((r["id"], r["layer_0"]) for r in table.scan(selected_fields=("id", "layer_0")).to_arrow().to_pylist()))


def listing(*folders):
    """Every path under the folders (with size and mtime), and whether each folder exists."""
    out = {}
    for folder in folders:
        out[folder] = os.path.exists(folder)
        for d, _, files in os.walk(folder):
            for f in files:
                st = os.stat(os.path.join(d, f))
                out[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return out


def one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def registered(tiny_model_files, tmp_path):
    """An output of a small corpus, registered in TABLE of a SQLite catalog."""
    corpus, out, wh = write_corpus(str(tmp_path / "a.txt"), n_docs=5, seed=3), str(tmp_path / "out"), tmp_path / "wh"
    wh.mkdir()
    args = argv(tiny_model_files, corpus, out, *SMALL, *ice(wh))
    assert main(args) == 0
    return dict(corpus=corpus, out=out, wh=wh, args=args)


def test_overwrite_without_the_table_of_a_registered_output_is_refused(registered, tiny_model_files, capsys):
    out, wh = registered["out"], registered["wh"]
    before = listing(out)
    capsys.readouterr()
    assert main(argv(tiny_model_files, registered["corpus"], out, *SMALL, "--layers", "top", "--overwrite")) == 2
    err = one_error(capsys)
    assert f"registered in Iceberg table {TABLE}" in err and "replaced files" in err and "(exit 2" in err
    assert listing(out) == before                                  # nothing replaced
    table = catalog_of(wh).load_table(TABLE)
    assert table_rows(table) == parquet_rows(out)                  # the table serves the output's rows
    # the same output registered by a later command records that table too
    other = wh / "other"
    other.mkdir()
    assert main(registered["args"][:-1] + [f"sqlite:///{other}/catalog.db"]) == 0
    assert json.load(open(os.path.join(out, "manifest.json")))["iceberg"] == [
        {"table": TABLE, "catalog": f"sqlite:///{other}/catalog.db"}]
    capsys.readouterr()
    assert main(registered["args"] + ["--overwrite"]) == 2         # the first table named, not the second
    assert f"registered in Iceberg table {TABLE} (catalog sqlite:///{other}/catalog.db)" in one_error(capsys)


def test_partitioned_table_is_refused_while_planning(registered, tiny_model_files, tmp_path, capsys):
    m = json.load(open(os.path.join(registered["out"], "manifest.json")))
    schema = pq.read_schema(data_file_urls(registered["out"], m)[0][len("file://"):])
    wh = tmp_path / "wh2"
    wh.mkdir()
    catalog = catalog_of(wh)
    catalog.create_namespace("elmo")
    table = catalog.create_table(TABLE, schema=schema)
    with table.update_spec() as spec:
        spec.add_identity("id")
    out = str(tmp_path / "new")
    capsys.readouterr()
    assert main(argv(tiny_model_files, registered["corpus"], out, *SMALL, *ice(wh))) == 2
    err = one_error(capsys)
    assert f"--iceberg-table {TABLE} is partitioned" in err and "without partition values" in err
    assert not os.path.exists(out)                                 # refused before any work
    assert catalog_of(wh).load_table(TABLE).current_snapshot() is None


def test_rerun_after_data_rewrite_and_snapshot_expiry_is_already_complete(registered, capsys):
    wh = registered["wh"]
    table = catalog_of(wh).load_table(TABLE)
    rows = table.scan().to_arrow()
    table.overwrite(rows)                                          # the same rows, rewritten into new files
    table = catalog_of(wh).load_table(TABLE)
    old = [s.snapshot_id for s in table.snapshots() if s.snapshot_id != table.current_snapshot().snapshot_id]
    table.maintenance.expire_snapshots().by_ids(old).commit()
    table = catalog_of(wh).load_table(TABLE)
    assert [s.snapshot_id for s in table.snapshots()] == [table.current_snapshot().snapshot_id]
    assert not any(f.file.file_path.startswith(f"file://{registered['out']}/") for f in table.scan().plan_files())
    capsys.readouterr()
    assert main(registered["args"]) == 0
    err = capsys.readouterr().err
    assert "already complete" in err and "already registered)" in err
    table = catalog_of(wh).load_table(TABLE)
    assert len(table.snapshots()) == 1 and table_rows(table) == parquet_rows(registered["out"])


def test_catalog_inside_the_output_is_refused_before_anything_is_written(tiny_model_files, tmp_path, capsys):
    corpus, out, wh = write_corpus(str(tmp_path / "c.txt"), n_docs=2), str(tmp_path / "out"), tmp_path / "wh"
    os.makedirs(out)
    before = listing(out, str(wh))
    assert main(argv(tiny_model_files, corpus, out, *ice(wh, f"sqlite:///{out}/cat.db"))) == 2
    err = one_error(capsys)
    assert f"--iceberg-catalog {out}/cat.db lies inside --output" in err and "(exit 2" in err
    assert listing(out, str(wh)) == before


def test_plan_and_dry_run_create_no_catalog_and_write_nothing(tiny_model_files, tmp_path):
    corpus, out, wh = write_corpus(str(tmp_path / "c.txt"), n_docs=2), str(tmp_path / "out"), tmp_path / "wh"
    before = listing(out, str(wh))
    # with a catalog not there yet, then with one that exists
    args = argv(tiny_model_files, corpus, out, *ice(wh))
    assert cli_main(["plan", *args]) == 0
    assert main([*args, "--dry-run"]) == 0
    assert listing(out, str(wh)) == before and not os.path.exists(wh)
    wh.mkdir()
    catalog_of(wh).create_namespace("elmo")
    before = listing(out, str(wh))
    assert cli_main(["plan", *args]) == 0
    assert main([*args, "--dry-run"]) == 0
    assert listing(out, str(wh)) == before
