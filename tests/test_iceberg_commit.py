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


def test_a_finished_output_changed_since_is_never_registered(tiny_model_files, tmp_path, capsys):
    """A finished output registered later (--iceberg-table newly given): a shard changed in place at its size since
    the run finished (another run's file copied over it, an edit) is not the output its manifest records: one line,
    exit 2, nothing added to the table and the manifest left as it was; put back, the same command registers it."""
    corpus, out, wh = write_corpus(str(tmp_path / "a.txt"), n_docs=5, seed=3), str(tmp_path / "out"), tmp_path / "wh"
    wh.mkdir()
    assert main(argv(tiny_model_files, corpus, out, *SMALL)) == 0
    m = json.load(open(os.path.join(out, "manifest.json")))
    shard = data_file_urls(out, m)[0][len("file://"):]
    original = open(shard, "rb").read()
    chunk = pq.ParquetFile(shard).metadata.row_group(0).column(pq.read_schema(shard).get_field_index("layer_2"))
    at = chunk.data_page_offset + chunk.total_compressed_size // 2        # inside a vector page: the footer reads
    changed = bytearray(original)
    changed[at] ^= 0xFF
    open(shard, "wb").write(bytes(changed))
    args = argv(tiny_model_files, corpus, out, *SMALL, *ice(wh), "--id-root", str(tmp_path))
    manifest_before = open(os.path.join(out, "manifest.json"), "rb").read()
    capsys.readouterr()
    assert main(args) == 2
    err = one_error(capsys)
    assert f"{shard}: not the file its writer recorded" in err and f"nothing was added to Iceberg table {TABLE}" in err
    assert "(exit 2" in err
    assert catalog_of(wh).load_table(TABLE).current_snapshot() is None
    assert open(os.path.join(out, "manifest.json"), "rb").read() == manifest_before
    open(shard, "wb").write(original)
    assert main(args) == 0
    table = catalog_of(wh).load_table(TABLE)
    assert len(table.snapshots()) == 1 and table_rows(table) == parquet_rows(out)


def test_racing_appends_of_the_same_ids_never_both_commit(tmp_path):
    """Two outputs holding the same ids registered at once: each checks the table's ids against the head it read,
    so the later commit must not be rebased by pyiceberg onto the head the other moved (it would add every id a
    second time): it rereads the table and is refused (DuplicateIdError), and the table holds each id once."""
    import pyarrow as pa
    from elmo_pipeline.formats.iceberg import DuplicateIdError, IcebergTarget
    outs = []
    for name in ("x", "y"):
        os.makedirs(tmp_path / name / "parquet")
        pq.write_table(pa.table({"id": ["d0#0", "d1#0"], "doc_id": ["d0", "d1"], "layer_0": [[1.0], [2.0]]}),
                       tmp_path / name / "parquet" / "part-00000-of-00001.parquet")
        outs.append((str(tmp_path / name), {"shards": [{"parquet": "parquet/part-00000-of-00001.parquet"}],
                                            "run": {"key": f"key-{name}"}}))
    target = IcebergTarget(TABLE, f"sqlite:///{tmp_path}/catalog.db")

    def the_other_first():
        target.register(*outs[1])
    with pytest.raises(DuplicateIdError, match="already holds 2 of the 2 ids"):
        target.register(*outs[0], before_commit=the_other_first)
    ids = catalog_of(tmp_path).load_table(TABLE).scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    assert sorted(ids) == ["d0#0", "d1#0"]


def crafted_output(folder, ids):
    """A finished output of one Parquet shard holding `ids` (sentence ids; doc_id their document), as register()
    takes it: (folder, manifest)."""
    import pyarrow as pa
    os.makedirs(folder / "parquet", exist_ok=True)
    pq.write_table(pa.table({"id": ids, "doc_id": [i.rpartition("#")[0] for i in ids],
                             "layer_0": [[float(k)] for k in range(len(ids))]}),
                   folder / "parquet" / "part-00000-of-00001.parquet")
    return str(folder), {"shards": [{"parquet": "parquet/part-00000-of-00001.parquet"}],
                         "run": {"key": f"key-{folder.name}"}}


@pytest.mark.parametrize("swap", ["fifo", "other size"])
def test_a_table_file_changed_since_it_was_added_is_never_read(tmp_path, swap):
    """A data file the table references, replaced since it was added by a FIFO (a read would block for good) or by
    a file of another size: the duplicate-id check of the next registration and an upsert's row positions
    (live_deletes) refuse it (TableFileChanged, exit 65) before opening it; nothing is committed."""
    import threading
    import pyarrow as pa
    from elmo_pipeline.formats.iceberg import IcebergTarget
    from elmo_pipeline.formats.iceberg.commit import TableFileChanged
    from elmo_pipeline.formats.iceberg.upsert import live_deletes
    from elmo_pipeline.pipeline.exits import classify
    target = IcebergTarget(TABLE, f"sqlite:///{tmp_path}/catalog.db")
    x = crafted_output(tmp_path / "x", ["d0#0", "d1#0"])
    target.register(*x)
    shard = os.path.join(x[0], x[1]["shards"][0]["parquet"])
    os.remove(shard)
    if swap == "fifo":
        os.mkfifo(shard)
    else:
        pq.write_table(pa.table({"id": ["e0#0"], "doc_id": ["e0"], "layer_0": [[9.0]]}), shard)
    got = {}

    def attempt(name, call):
        try:
            call()
        except Exception as e:  # noqa: BLE001
            got[name] = e
    table = catalog_of(tmp_path).load_table(TABLE)
    calls = {"register": lambda: target.register(*crafted_output(tmp_path / "y", ["d0#0", "d2#0"])),
             "live_deletes": lambda: live_deletes(table, pa.array(["d1"]))}
    threads = {n: threading.Thread(target=attempt, args=(n, c), daemon=True) for n, c in calls.items()}
    for t in threads.values():
        t.start()
        t.join(60)
    if swap == "fifo" and any(t.is_alive() for t in threads.values()):
        with open(shard, "wb"):          # let a blocked reader go
            pass
    assert not any(t.is_alive() for t in threads.values()), "a read blocked on the FIFO"
    for name in calls:
        assert isinstance(got.get(name), TableFileChanged), (name, got.get(name))
        assert f"{shard}: " in str(got[name]) and classify(got[name]).status == 65
    assert len(catalog_of(tmp_path).load_table(TABLE).snapshots()) == 1


@pytest.mark.parametrize("warehouse", ["wh?X-Amz-Signature=SECRET1", "wh#token=SECRET1", "key:SECRET1@wh"])
def test_a_warehouse_url_with_a_query_fragment_or_user_info_is_refused(warehouse, tiny_model_files, tmp_path, capsys):
    """pyiceberg's file I/O drops a warehouse URL's query or fragment: the table's metadata files were all written to
    the one path before it (over each other, and over a file of the user's there: a table that then fails to load),
    and the URL, credential included, kept in the catalog. Refused before any work, the credential not printed."""
    corpus, out = write_corpus(str(tmp_path / "c.txt"), n_docs=2), str(tmp_path / "out")
    (tmp_path / "wh").write_bytes(b"the user's file")
    url = f"file://{tmp_path}/{warehouse}" if "@" not in warehouse else f"s3://{warehouse}"
    before = listing(str(tmp_path))
    capsys.readouterr()
    assert main(argv(tiny_model_files, corpus, out, *ice(tmp_path), "--iceberg-warehouse", url)) == 2
    err = capsys.readouterr().err
    line = one_error_of(err)
    assert "--iceberg-warehouse" in line and "query, a fragment or user info" in line and "(exit 2" in line
    assert "SECRET1" not in err
    assert listing(str(tmp_path)) == before                          # no catalog, no table, the user's file kept


def test_a_sqlite_catalog_uri_query_is_not_part_of_the_default_warehouse(tmp_path):
    from elmo_pipeline.formats.iceberg import IcebergTarget
    target = IcebergTarget(TABLE, f"sqlite:///{tmp_path}/cat.db?mode=rwc&x=a/b")
    assert target.properties()["warehouse"] == f"file://{tmp_path}"


def one_error_of(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("status,code", [(500, 75), (429, 75), (503, 75), (401, 2)])
def test_a_rest_catalog_failing_for_now_is_retry_later_and_its_credentials_unprinted(status, code, tiny_model_files,
                                                                                        tmp_path, capsys):
    """A REST catalog (--iceberg-catalog http://user:password@host/...?token=...) answering 500 or 429 while the
    run plans: pyiceberg's ServerError or TooManyRequestsError was exit 2 (fix the command: a scheduler never
    retried); now exit 75 like the 503 and any storage's 5xx; a 401 stays the command's. No credential printed."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"error": {"message": "not now", "type": "X", "code": status}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://alice:SECRET1@127.0.0.1:{server.server_address[1]}/cat?token=SECRET2"
        out = str(tmp_path / "out")
        capsys.readouterr()
        assert main(argv(tiny_model_files, write_corpus(str(tmp_path / "c.txt"), 2), out, "--iceberg-table", TABLE,
                         "--iceberg-catalog", uri)) == code
        err = capsys.readouterr().err
        assert f"(exit {code}" in one_error_of(err) and "SECRET" not in err
        assert not os.path.exists(out)
    finally:
        server.shutdown()
        server.server_close()
