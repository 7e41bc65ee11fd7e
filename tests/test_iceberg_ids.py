"""Ids unique in an Iceberg table: partitions whose files share a name (dt=1/part-0.txt, dt=2/part-0.txt) get
distinct default ids with --iceberg-table (each file's full path), and a registration that would add an id
the table holds already is refused (exit 65, one line), the table unchanged, whether the output was just
written or was finished before and only registers. Runs without --iceberg-table keep their ids."""
import json
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from elmo_pipeline.pipeline import exits
from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv, write_corpus
from elmo_pipeline.transforms.ids import file_labels

pyiceberg = pytest.importorskip("pyiceberg")
from pyiceberg.catalog import load_catalog  # noqa: E402
from pyiceberg.expressions import And, GreaterThanOrEqual, LessThanOrEqual  # noqa: E402

from elmo_pipeline.formats.iceberg.commit import DuplicateIdError, check_new_ids  # noqa: E402
from elmo_pipeline.formats.iceberg.table import ID_METRICS_PROPERTY  # noqa: E402

TABLE = "elmo.v"
SMALL = ("--shard-sentences", "5", "--max-tokens-per-batch", "256")


def ice(wh):
    return ("--iceberg-table", TABLE, "--iceberg-catalog", f"sqlite:///{wh}/catalog.db")


def table_of(wh):
    return load_catalog("default", uri=f"sqlite:///{wh}/catalog.db", warehouse=f"file://{wh}").load_table(TABLE)


def output_ids(out) -> list[str]:
    return ds.dataset(os.path.join(out, "parquet"), format="parquet").to_table(columns=["id"]).column(0).to_pylist()


def state(wh):
    """(current snapshot id, rows) of the table."""
    table = table_of(wh)
    return table.current_snapshot().snapshot_id, table.scan().to_arrow().num_rows


@pytest.fixture
def partitions(tmp_path):
    """Two daily partition folders each holding a file named part-0.txt (different text), and a warehouse."""
    data = tmp_path / "data"
    for day, seed in (("1", 1), ("2", 2)):
        (data / f"dt={day}").mkdir(parents=True)
        write_corpus(str(data / f"dt={day}" / "part-0.txt"), n_docs=8, seed=seed)
    (tmp_path / "wh").mkdir()
    return data, tmp_path / "wh"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# --- file labels -------------------------------------------------------------------------------------------

def test_file_labels_relative_to_the_id_root(tmp_path, monkeypatch):
    files = [str(tmp_path / "data" / "dt=1" / "part-0.txt"), str(tmp_path / "data" / "dt=2" / "part-0.txt")]
    assert file_labels(files, str(tmp_path / "data")) == {files[0]: "dt=1/part-0.txt", files[1]: "dt=2/part-0.txt"}
    assert file_labels(files[:1], str(tmp_path / "data") + "/") == {files[0]: "dt=1/part-0.txt"}   # one file
    monkeypatch.chdir(tmp_path)
    assert file_labels(files, "data/")[files[1]] == "dt=2/part-0.txt"              # a relative root
    assert file_labels(files, f"file://{tmp_path}")[files[0]] == "data/dt=1/part-0.txt"
    assert file_labels(files, "/")[files[0]] == files[0].lstrip("/")
    remote = ["s3://corpus/dt=1/part-0.txt", "s3://corpus/dt=2/part-0.txt"]
    assert file_labels(remote, "s3://corpus/") == {remote[0]: "dt=1/part-0.txt", remote[1]: "dt=2/part-0.txt"}
    assert file_labels(["https://u:pw@host/c/dt=1/p.txt?sig=s3cr3t"], "https://host/c") == {
        "https://u:pw@host/c/dt=1/p.txt?sig=s3cr3t": "dt=1/p.txt"}
    for root, inputs in ((str(tmp_path / "data" / "dt=1"), files), ("gs://corpus", remote),
                         (str(tmp_path / "dat"), files), (files[0], files[:1])):
        with pytest.raises(ValueError, match="is not under it"):
            file_labels(inputs, root)
    with pytest.raises(ValueError) as e:
        file_labels(["https://u:pw@host/c/p.txt?sig=s3cr3t"], "https://u:pw@host/other?sig=s3cr3t")
    assert "pw" not in str(e.value) and "s3cr3t" not in str(e.value) and "https://host/c/p.txt" in str(e.value)


def test_full_labels_keep_the_scheme_and_drop_credentials_and_queries(tmp_path):
    local = str(tmp_path / "dt=1" / "part-0.txt")
    assert file_labels([local], full=True) == {local: local}
    assert file_labels([f"file://{local}"], full=True) == {f"file://{local}": local}
    urls = ["s3://corpus/dt=1/part-0.txt", "https://user:pw@host/c/part-0.txt?X-Amz-Signature=abc#frag"]
    assert file_labels(urls, full=True) == {urls[0]: urls[0], urls[1]: "https://host/c/part-0.txt"}
    # without --iceberg-table or --id-root: the labels of before (relative to the common folder, a lone file's name)
    two = [str(tmp_path / "dt=1" / "part-0.txt"), str(tmp_path / "dt=2" / "part-0.txt")]
    assert file_labels(two) == {two[0]: "dt=1/part-0.txt", two[1]: "dt=2/part-0.txt"}
    assert file_labels([local]) == {local: "part-0.txt"}


def test_an_input_outside_the_id_root_is_a_usage_error(partitions, tiny_model_files, tmp_path, capsys):
    data, _ = partitions
    out = str(tmp_path / "out")
    assert main(argv(tiny_model_files, str(data / "dt=1" / "part-0.txt"), out, "--id-root",
                     str(data / "dt=2"))) == exits.USAGE
    assert "is not under it" in one_error_line(capsys)
    assert not os.path.exists(out)


# --- the pipeline ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_partitions_with_same_named_files_get_distinct_ids_in_the_table(partitions, tiny_model_files, tmp_path):
    data, wh = partitions
    outs = [str(tmp_path / "out" / f"dt={day}") for day in ("1", "2")]
    for day, out in zip(("1", "2"), outs):
        assert main(argv(tiny_model_files, str(data / f"dt={day}" / "*.txt"), out, *SMALL, *ice(wh))) == 0
    table = table_of(wh)
    ids = table.scan().to_arrow().column("id").to_pylist()
    assert len(ids) == sum(len(output_ids(o)) for o in outs) and len(ids) == len(set(ids))
    assert all(i.startswith(str(data / "dt=")) for i in ids)        # the file's full path: <path>:<line>...
    assert table.properties[ID_METRICS_PROPERTY] == "full"
    # the duplicate check's scan over the second partition's id range plans its own files alone
    theirs = output_ids(outs[1])
    scan = table.scan(row_filter=And(GreaterThanOrEqual("id", min(theirs)), LessThanOrEqual("id", max(theirs))))
    assert {f.file.file_path.rsplit("/parquet/", 1)[0] for f in scan.plan_files()} == {f"file://{outs[1]}"}


@pytest.mark.slow
def test_same_input_from_a_second_output_is_refused_and_the_table_unchanged(partitions, tiny_model_files, tmp_path,
                                                                           capsys):
    data, wh = partitions
    day1 = str(data / "dt=1" / "part-0.txt")
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    assert main(argv(tiny_model_files, day1, first, *SMALL, *ice(wh))) == 0
    before = state(wh)
    capsys.readouterr()
    args = argv(tiny_model_files, day1, second, *SMALL, *ice(wh))
    for _ in range(2):            # the run, then its rerun (which only finishes the finalize): refused both times
        assert main(args) == exits.DATA
        err = one_error_line(capsys)
        assert "DuplicateIdError" in err and f"already holds {len(set(output_ids(first)))} of the" in err, err
        assert "(exit 65: fix the data)" in err and f"{day1}:1" in err
        assert state(wh) == before
        assert not os.path.exists(os.path.join(second, "_SUCCESS"))
    assert main(argv(tiny_model_files, day1, first, *SMALL, *ice(wh))) == 0      # its own files: idempotent
    assert "already registered" in capsys.readouterr().err and state(wh) == before


@pytest.mark.slow
def test_a_finished_output_that_only_registers_is_refused_on_duplicate_ids(partitions, tiny_model_files, tmp_path,
                                                                          capsys):
    """Outputs written without --iceberg-table (ids part-0.txt:<line> in both), registered afterwards with the
    --id-root that gives those ids (same run key: 'already complete', nothing rerun)."""
    data, wh = partitions
    outs = {day: str(tmp_path / f"plain-{day}") for day in ("1", "2")}
    for day, out in outs.items():
        assert main(argv(tiny_model_files, str(data / f"dt={day}" / "part-0.txt"), out, *SMALL)) == 0
    assert set(output_ids(outs["1"])) & set(output_ids(outs["2"]))
    register = {day: argv(tiny_model_files, str(data / f"dt={day}" / "part-0.txt"), out, *SMALL, *ice(wh),
                          "--id-root", str(data / f"dt={day}")) for day, out in outs.items()}
    assert main(register["1"]) == 0
    assert "already complete" in capsys.readouterr().err
    before = state(wh)
    manifest = open(os.path.join(outs["2"], "manifest.json")).read()
    assert main(register["2"]) == exits.DATA
    assert "DuplicateIdError" in one_error_line(capsys)
    assert state(wh) == before and open(os.path.join(outs["2"], "manifest.json")).read() == manifest
    assert os.path.exists(os.path.join(outs["2"], "_SUCCESS"))       # the finished output is left as it was


@pytest.mark.slow
def test_id_field_values_repeated_across_partitions_are_refused(tiny_model_files, tmp_path, capsys):
    wh = tmp_path / "wh"
    wh.mkdir()

    def day(n, ids):
        path = tmp_path / f"day{n}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": f"Document {i} of day {n}."}) + "\n" for i in ids))
        return main(argv(tiny_model_files, str(path), str(tmp_path / f"out{n}"), *ice(wh), "--input-format", "jsonl",
                         "--id-field", "id"))

    assert day(1, ("a", "b", "c")) == 0
    before = state(wh)
    capsys.readouterr()
    assert day(2, ("d", "b")) == exits.DATA
    err = one_error_line(capsys)
    assert "already holds 1 of the 2 ids" in err and "(e.g. 'b#0')" in err, err
    assert state(wh) == before


def test_check_new_ids_reads_the_ids_of_the_table(tmp_path):
    catalog = load_catalog("default", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}")
    catalog.create_namespace("ns")
    table = catalog.create_table("ns.t", schema=pa.schema([("id", pa.string())]),
                                 properties={ID_METRICS_PROPERTY: "full"})
    check_new_ids(table, pa.array(["x"]), "out")                       # an empty table holds nothing
    table.append(pa.table({"id": pa.array(["a", "b", "c"], pa.string())}))
    check_new_ids(table, pa.array(["d", "e"]), "out")
    with pytest.raises(DuplicateIdError, match=r"already holds 1 of the 2 ids of out \(e\.g\. 'c'\)"):
        check_new_ids(table, pa.array(["c", "zz"]), "out")
