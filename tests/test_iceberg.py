"""--iceberg-table: the run's Parquet shards in an Apache Iceberg table (pyiceberg's SQL catalog on SQLite).

Read back through pyiceberg, the table holds exactly the Parquet files' rows (ids, tokens, vectors); each
output is one append snapshot, added once: a rerun of a finished output, or of a Finalize killed just before
or just after the files were added (a real SIGKILL), leaves one snapshot and no row twice. Runs without the
flag are unchanged (same run key, same bytes); bad combinations fail before any work with one line."""
import glob
import hashlib
import json
import os
import shutil
import sys

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv, read_output, run_subprocess, write_corpus

pyiceberg = pytest.importorskip("pyiceberg")
from pyiceberg.catalog import load_catalog  # noqa: E402

from elmo_pipeline.formats.iceberg.commit import OUTPUT_PROPERTY, RUN_KEY_PROPERTY  # noqa: E402
from elmo_pipeline.formats.iceberg import IcebergTarget, data_file_urls, output_url  # noqa: E402
from elmo_pipeline.fsio import redact  # noqa: E402
from elmo_pipeline.formats.parquet import shard_schema  # noqa: E402

TABLE = "elmo.vectors"
SMALL = ("--shard-sentences", "5", "--max-tokens-per-batch", "256")


def same_content(manifest: dict) -> dict:
    """A manifest without what two runs of the same content may differ in: options, and the records of the run
    report and metrics.prom (their timings)."""
    files = {n: r for n, r in manifest.get("files", {}).items() if n not in ("report.html", "metrics.prom")}
    return {k: v for k, v in manifest.items() if k not in ("options", "files")} | {"files": files}


def catalog_uri(folder) -> str:
    return f"sqlite:///{folder}/catalog.db"


def ice(folder, table=TABLE):
    return ("--iceberg-table", table, "--iceberg-catalog", catalog_uri(folder))


def table_of(folder, table=TABLE):
    return load_catalog("default", uri=catalog_uri(folder), warehouse=f"file://{folder}").load_table(table)


def marked(table, out):
    """The table's snapshots that registered the output folder `out`."""
    return [s for s in table.snapshots() if s.summary.additional_properties.get(OUTPUT_PROPERTY) == output_url(out)]


def sorted_rows(table):
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def assert_table_holds(table, outs):
    """The table's rows are exactly those of the Parquet shards of the outputs `outs` (by manifest), once."""
    manifests = [json.load(open(os.path.join(o, "manifest.json"))) for o in outs]
    files = [f for o, m in zip(outs, manifests) for f in data_file_urls(o, m)]
    assert sorted(df.file.file_path for df in table.scan().plan_files()) == sorted(files)
    got = table.scan().to_arrow()
    want = ds.dataset([f[len("file://"):] for f in files], format="parquet").to_table()
    assert got.num_rows == want.num_rows == sum(m["counts"]["sentences_written"] for m in manifests)
    assert got.column_names == want.column_names
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a sentence is twice in the table"
    assert sorted_rows(got) == sorted_rows(want)     # ids, tokens, offsets, every vector, float for float


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def runs(tiny_model_files, tmp_path_factory):
    """Two corpora; corpus a run without and with --iceberg-table, corpus b into the same table."""
    d = tmp_path_factory.mktemp("iceberg")
    a, b = write_corpus(str(d / "a.txt"), n_docs=6, seed=1), write_corpus(str(d / "b.txt"), n_docs=5, seed=2)
    plain, first, second, warehouse = str(d / "plain"), str(d / "first"), str(d / "second"), d / "wh"
    warehouse.mkdir()
    assert main(argv(tiny_model_files, a, plain, *SMALL)) == 0
    # --id-root: the ids a run without --iceberg-table gives (with it, by default, each file's full path)
    assert main(argv(tiny_model_files, a, first, *SMALL, *ice(warehouse), "--id-root", str(d))) == 0
    after_first = [s.snapshot_id for s in table_of(warehouse).snapshots()]
    assert main(argv(tiny_model_files, b, second, *SMALL, *ice(warehouse))) == 0
    return dict(a=a, b=b, plain=plain, first=first, second=second, wh=warehouse, after_first=after_first)


def test_table_holds_the_parquet_files_rows_ids_and_vectors(runs):
    table = table_of(runs["wh"])
    assert len(runs["after_first"]) == 1                       # one output, one snapshot
    assert len(table.snapshots()) == 2                          # a second output, a second snapshot
    m = json.load(open(os.path.join(runs["first"], "manifest.json")))
    (snap,) = marked(table, runs["first"])
    assert snap.snapshot_id == runs["after_first"][0] and snap.summary.operation.value == "append"
    assert snap.summary.additional_properties[RUN_KEY_PROPERTY] == m["run"]["key"]
    assert len(m["shards"]) >= 2
    assert_table_holds(table, [runs["first"], runs["second"]])
    # the table as of the first snapshot: the first output alone
    first_only = table.scan(snapshot_id=snap.snapshot_id).to_arrow()
    assert sorted(first_only.column("id").to_pylist()) == sorted(
        ds.dataset(os.path.join(runs["first"], "parquet"), format="parquet").to_table().column("id").to_pylist())


def test_the_flags_change_no_file_and_not_the_run_key(runs):
    mp, mi = (json.load(open(os.path.join(runs[k], "manifest.json"))) for k in ("plain", "first"))
    assert mp["run"]["key"] == mi["run"]["key"]
    assert [s["parquet"] for s in mp["shards"]] == [s["parquet"] for s in mi["shards"]]
    for s in mp["shards"]:
        for fmt in ("parquet", "hdf5"):
            assert sha(os.path.join(runs["plain"], s[fmt])) == sha(os.path.join(runs["first"], s[fmt]))
    assert mi["options"]["iceberg_table"] == TABLE and mp["options"]["iceberg_table"] is None
    assert same_content(mp) == same_content(mi)


def test_finished_output_registered_when_the_flag_is_new_then_never_again(runs, tiny_model_files, tmp_path, capsys):
    wh = tmp_path / "wh"
    wh.mkdir()
    args = argv(tiny_model_files, runs["a"], runs["plain"], *SMALL, *ice(wh), "--id-root", os.path.dirname(runs["a"]))
    before = {p: os.stat(os.path.join(runs["plain"], p)).st_mtime_ns for p in os.listdir(runs["plain"])}
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "already complete" in err and "(" in err and "added)" in err
    assert main(args) == 0
    assert "already registered)" in capsys.readouterr().err
    table = table_of(wh)
    assert len(table.snapshots()) == 1 and len(marked(table, runs["plain"])) == 1
    assert_table_holds(table, [runs["plain"]])
    after = {p: os.stat(os.path.join(runs["plain"], p)).st_mtime_ns for p in os.listdir(runs["plain"])}
    assert {p: t for p, t in after.items() if p != "manifest.json"} == {p: t for p, t in before.items()
                                                                        if p != "manifest.json"}
    # the manifest records the table alone (the output knows it is registered: --overwrite without it is refused)
    m = json.load(open(os.path.join(runs["plain"], "manifest.json")))
    assert m.pop("iceberg") == [{"table": TABLE, "catalog": catalog_uri(wh)}]
    assert same_content(m) == same_content(json.load(open(os.path.join(runs["first"], "manifest.json"))))


def test_overwrite_of_a_registered_output_is_refused(runs, tiny_model_files, capsys):
    snapshots = len(table_of(runs["wh"]).snapshots())
    before = sha(os.path.join(runs["first"], "manifest.json"))
    assert main(argv(tiny_model_files, runs["a"], runs["first"], *SMALL, *ice(runs["wh"]), "--overwrite")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite would replace them" in err and "new --output" in err
    assert sha(os.path.join(runs["first"], "manifest.json")) == before
    assert len(table_of(runs["wh"]).snapshots()) == snapshots


def test_registered_output_deleted_by_hand_is_refused(runs, tiny_model_files, tmp_path, capsys):
    out = str(tmp_path / "gone")
    shutil.copytree(runs["second"], out)
    wh = tmp_path / "wh"
    wh.mkdir()
    args = argv(tiny_model_files, runs["b"], out, *SMALL, *ice(wh))
    assert main(args) == 0                       # the copy, complete, registered now
    shutil.rmtree(out)
    assert main(args) == 2
    assert "no longer holds the finished run" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_table_of_another_schema_is_refused(runs, tiny_model_files, tmp_path, capsys):
    out = str(tmp_path / "top")
    assert main(argv(tiny_model_files, runs["a"], out, *SMALL, *ice(runs["wh"]), "--layers", "top")) == 2
    err = capsys.readouterr().err
    assert "another schema" in err and "only in the table: layer_0, layer_1" in err
    assert not os.path.exists(out)


def test_shard_schema_is_the_schema_written(runs):
    m = json.load(open(os.path.join(runs["first"], "manifest.json")))
    written = pq.read_schema(os.path.join(runs["first"], m["shards"][0]["parquet"]))
    planned = shard_schema("sentence", list(m["layer_dims"].items()), "float32")
    assert [f.name for f in written] == [f.name for f in planned]
    assert [str(f.type).replace("element", "item") for f in written] == [str(f.type) for f in planned]


@pytest.mark.parametrize("extra,message", [
    (("--iceberg-table", TABLE), "needs --iceberg-catalog"),
    (("--iceberg-catalog", "sqlite:///x.db"), "need --iceberg-table"),
    (("--iceberg-table", "vectors", "--iceberg-catalog", "sqlite:///x.db"), "takes NAMESPACE.TABLE"),
    (("--iceberg-table", TABLE, "--iceberg-catalog", "sqlite:///x.db", "--format", "hdf5"), "must include parquet"),
    (("--iceberg-table", TABLE, "--iceberg-catalog", "sqlite:///x.db", "--dtype", "float16"), "--dtype float32"),
    (("--iceberg-table", TABLE, "--iceberg-catalog", "sqlite:///:memory:"), "a catalog in this process's memory"),
])
def test_bad_flag_combinations_fail_before_any_work(extra, message, tiny_model_files, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(argv(tiny_model_files, write_corpus(str(tmp_path / "c.txt"), 2), out, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not os.path.exists(out) and not os.path.exists("x.db")


def test_without_pyiceberg_the_error_names_the_extra(monkeypatch, tiny_model_files, tmp_path, capsys):
    for name in [n for n in sys.modules if n == "pyiceberg" or n.startswith("pyiceberg.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyiceberg", None)          # import pyiceberg -> ImportError
    out = str(tmp_path / "out")
    assert main(argv(tiny_model_files, write_corpus(str(tmp_path / "c.txt"), 2), out, *ice(tmp_path))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'elmo-pipeline[iceberg]'" in err, err
    assert not os.path.exists(out)


def test_register_is_idempotent_and_refuses_a_partial_table(runs, tmp_path):
    out = runs["first"]
    m = json.load(open(os.path.join(out, "manifest.json")))
    target = IcebergTarget("ns.t", catalog_uri(tmp_path))
    r1 = target.register(out, m)                     # schema from the first shard
    r2 = target.register(out, m)
    assert r1.added and not r2.added and r1.snapshot_id == r2.snapshot_id and r1.files == len(m["shards"])
    assert len(table_of(tmp_path, "ns.t").snapshots()) == 1
    # another table holding one of the files by other means: neither added again nor silently skipped
    other = IcebergTarget("ns.partial", catalog_uri(tmp_path))
    table = load_catalog("default", uri=catalog_uri(tmp_path), warehouse=f"file://{tmp_path}").create_table(
        "ns.partial", schema=pq.read_schema(data_file_urls(out, m)[0][len("file://"):]))
    table.add_files(data_file_urls(out, m)[:1])
    with pytest.raises(RuntimeError, match="are in the table already, the others not"):
        other.register(out, m)
    assert target.register(out, {"shards": [], "run": {"key": "k"}}).snapshot_id is None


@pytest.mark.parametrize("registered_by", ["link", "folder"])
def test_overwrite_of_an_output_registered_under_another_spelling_is_refused(registered_by, tiny_model_files,
                                                                            tmp_path, capsys):
    """An output registered through a symbolic link to its folder, then --overwrite naming the folder itself (or the
    other way round): the table references files under it, so it is refused (2), every file as it was (red team:
    the table's paths were compared as spelled, so the run replaced the files the table references)."""
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=4, seed=3)
    real, link, wh = tmp_path / "real", tmp_path / "link", tmp_path / "wh"
    real.mkdir()
    wh.mkdir()
    link.symlink_to(real)
    first, again = (link, real) if registered_by == "link" else (real, link)
    base = (*SMALL, *ice(wh), "--id-root", str(tmp_path))
    assert main(argv(tiny_model_files, corpus, str(first), *base)) == 0
    before = {f: sha(f) for f in sorted(glob.glob(str(real / "parquet" / "*.parquet")))}
    capsys.readouterr()
    assert main(argv(tiny_model_files, corpus, str(again), *base, "--window-tokens", "100", "--overwrite")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite would replace them" in err, err
    assert {f: sha(f) for f in sorted(glob.glob(str(real / "parquet" / "*.parquet")))} == before
    assert len(table_of(wh).snapshots()) == 1


def test_catalog_password_is_not_recorded():
    assert redact("postgresql+psycopg2://user:secret@db:5432/cat") == "postgresql+psycopg2://***@db:5432/cat"
    assert redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["register:1", "registered:1"])
def test_finalize_killed_around_the_registration_then_rerun_registers_once(point, tiny_model_files, tmp_path):
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=8, seed=3)
    out, wh = str(tmp_path / "out"), tmp_path / "wh"
    wh.mkdir()
    args = argv(tiny_model_files, corpus, out, *SMALL, *ice(wh))
    p = run_subprocess(args, point)                       # SIGKILL just before / just after add_files
    assert p.returncode == -9, p.stderr[-2000:]
    assert os.path.exists(os.path.join(out, "manifest.json")) and not os.path.exists(os.path.join(out, "_SUCCESS"))
    catalog = load_catalog("default", uri=catalog_uri(wh), warehouse=f"file://{wh}")
    if point == "register:1":
        assert not catalog.table_exists(TABLE)
    else:
        assert len(catalog.load_table(TABLE).snapshots()) == 1
    p = run_subprocess(args)                              # the same command: it finishes the finalize
    assert p.returncode == 0, p.stderr[-2000:]
    assert "finished the interrupted finalize" in p.stderr
    assert ("already registered" if point == "registered:1" else "added)") in p.stderr
    m = read_output(out)[0]                               # whole: _SUCCESS, no staging, every file listed once
    table = table_of(wh)
    assert len(table.snapshots()) == 1 and len(marked(table, out)) == 1
    assert_table_holds(table, [out])
    assert table.scan().to_arrow().num_rows == m["counts"]["sentences"]
    p = run_subprocess(args)                              # and the same command once more: nothing to do
    assert p.returncode == 0 and "already complete" in p.stderr and "already registered" in p.stderr
    assert len(table_of(wh).snapshots()) == 1


@pytest.mark.slow
def test_a_registered_output_whose_finalize_would_start_over_is_refused_and_left_alone(tiny_model_files, tmp_path,
                                                                                      capsys):
    """Killed just after its files were added to the table (before _SUCCESS), then a listed file changed: a rerun
    would start over and remove the files the table references. It is refused (2), every file left in place."""
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=8, seed=3)
    out, wh = str(tmp_path / "out"), tmp_path / "wh"
    wh.mkdir()
    args = argv(tiny_model_files, corpus, out, *SMALL, *ice(wh))
    p = run_subprocess(args, "registered:1")
    assert p.returncode == -9, p.stderr[-2000:]
    listed = sorted(glob.glob(os.path.join(out, "parquet", "*.parquet")))
    with open(listed[0], "ab") as f:
        f.write(b"x")
    before = {f: sha(f) for f in listed}
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no longer holds the finished run of this command registered from it whole" in err, err
    assert {f: sha(f) for f in sorted(glob.glob(os.path.join(out, "parquet", "*.parquet")))} == before
    assert not os.path.exists(os.path.join(out, "_SUCCESS")) and len(table_of(wh).snapshots()) == 1


@pytest.mark.parametrize("name", ["emb#1", "emb?x=1"])
def test_an_output_name_a_table_url_cannot_carry_is_refused_while_planning(name, tiny_model_files, tmp_path, capsys):
    """A local --output holding '#' or '?' with --iceberg-table: one error line while planning (exit 2), nothing
    embedded, not exit 65 at registration on every rerun."""
    inp = tmp_path / "in.txt"
    inp.write_text("the cat sat .\n", encoding="utf-8")
    out = tmp_path / name
    assert main(argv(tiny_model_files, str(inp), str(out), *ice(tmp_path))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds '#' or '?'" in err, err
    assert not out.exists()
