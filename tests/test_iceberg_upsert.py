"""--iceberg-mode upsert: a table that mirrors a corpus, one change-only snapshot per day.

Three days of a JSONL corpus (documents made of WikiText-2 valid lines) upserted into one table: day 2 edits
documents, day 3 adds one and drops two (--delete-missing). After each day the table, read by pyiceberg and by
DuckDB over the data and position-delete files the scan plans, equals a fresh table of a full run of that
day's input (same ids, tokens, bit-identical vectors: the shipped model with --batch-invariant); each day adds
one snapshot; a rerun is `already complete` and adds none; time travel gives the earlier days; unchanged
documents are neither embedded nor written, and the files holding them stay as they are."""
import contextlib
import hashlib
import io
import json
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.formats.iceberg import IcebergTarget
from elmo_pipeline.formats.iceberg.upsert import change_counts, change_of, delete_positions, doc_hash, new_state
from elmo_pipeline.pipeline.run import main
from tests.iceberg_rows import same_rows, upsert_argv
from tests.conftest import shared_path

pyiceberg = pytest.importorskip("pyiceberg")
from pyiceberg.catalog import load_catalog  # noqa: E402

TABLE = "elmo.docs"
COMMON = ("--batch-invariant", "--torch-threads", "1", "--progress", "off", "--max-tokens-per-batch", "512")


# ---- pure functions ----------------------------------------------------------------------------------------

def test_doc_hash_is_the_text_under_the_settings():
    h = doc_hash("A text .", True, "salt")
    assert h == doc_hash("A text .", True, "salt") and len(h) == 32
    assert len({h, doc_hash("A text !", True, "salt"), doc_hash("A text .", False, "salt"),
                doc_hash("A text .", True, "other model")}) == 4


def test_change_of_and_the_next_state():
    state = {"a": "1", "b": "2", "c": "3"}
    assert [change_of(d, h, state) for d, h in (("a", "1"), ("b", "9"), ("z", "5"))] == ["unchanged", "changed",
                                                                                          "added"]
    seen = {"a": ("1", "unchanged"), "b": ("9", "changed"), "z": ("5", "added")}
    gone = new_state(state, seen, delete_missing=True)
    assert gone.to_pylist() == [{"doc_id": "a", "doc_hash": "1", "change": "unchanged"},
                                {"doc_id": "b", "doc_hash": "9", "change": "changed"},
                                {"doc_id": "c", "doc_hash": None, "change": "removed"},
                                {"doc_id": "z", "doc_hash": "5", "change": "added"}]
    kept = new_state(state, seen, delete_missing=False)
    assert kept.to_pylist()[2] == {"doc_id": "c", "doc_hash": "3", "change": "kept"}
    assert change_counts(gone) == {"documents_unchanged": 1, "documents_changed": 1, "documents_added": 1,
                                   "documents_removed": 1, "documents_kept": 0}


def test_delete_positions_skip_rows_already_deleted():
    rows = pa.array(["a", "b", "a", "c", "b", "a"])
    assert delete_positions(pa.array(["a", "c"]), rows).to_pylist() == [0, 2, 3, 5]
    assert delete_positions(pa.array(["a"]), rows, pa.array([0, 5], pa.int64())).to_pylist() == [2]
    assert delete_positions(pa.array(["x"]), rows).to_pylist() == []


# ---- refusals (exit 2, one line, before any work) -----------------------------------------------------------

@pytest.mark.parametrize("extra, says", [
    (("--iceberg-mode", "upsert"), "--iceberg-mode upsert needs --iceberg-table"),
    (("--delete-missing",), "--delete-missing needs --iceberg-mode upsert"),
    (("--iceberg-mode", "upsert", "--iceberg-table", TABLE, "--iceberg-catalog", "sqlite:////nonexistent/c.db",
      "--input-format", "text"), "--iceberg-mode upsert needs --input-format jsonl or parquet with --id-field"),
    (("--reuse-table",), "--reuse-table needs --iceberg-table"),
    (("--reuse-table", "--iceberg-table", TABLE, "--iceberg-catalog", "sqlite:////nonexistent/c.db", "--state",
      "stateful"), "--reuse-table needs --state stateless or warm"),
])
def test_upsert_flags_that_cannot_work_are_refused(tmp_path, capsys, extra, says):
    inp = tmp_path / "a.txt"
    inp.write_text("One document .\n")
    code = main(["--input", str(inp), "--output", str(tmp_path / "out"), "--format", "parquet", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and says in err[0], err
    assert not (tmp_path / "out").exists()


# ---- three days into one table ------------------------------------------------------------------------------

def write_jsonl(path, docs):
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs)
    return str(path)


def days():
    """Day 1: 24 documents of 1-2 WikiText-2 valid lines; day 2: 3 of them edited; day 3: one of those edited
    again, one added, two gone."""
    with open(shared_path("data", "wikitext-2", "valid.txt"), encoding="utf-8") as f:
        lines = [s.strip() for s in f if s.strip() and not s.strip().startswith("=")]
    lines = [s[:400] for s in lines[:60]]
    day1 = [(f"wiki-{i:03d}", " ".join(lines[2 * i: 2 * i + 1 + i % 2])) for i in range(24)]
    day2 = list(day1)
    for k in (2, 9, 17):
        day2[k] = (day2[k][0], day2[k][1] + " An edit adds this sentence .")
    day3 = [(i, t + " Edited once more ." if i == "wiki-009" else t) for i, t in day2
            if i not in ("wiki-004", "wiki-020")]
    day3.append(("wiki-100", lines[55]))
    return day1, day2, day3


def catalog(folder):
    return f"sqlite:///{folder}/catalog.db"


def table_of(folder):
    return load_catalog("default", uri=catalog(folder), warehouse=f"file://{folder}").load_table(TABLE)


def rows(table, snapshot_id=None):
    got = table.scan(snapshot_id=snapshot_id).to_arrow()
    return sorted(got.to_pylist(), key=lambda r: r["id"])


def duckdb_rows(table):
    """The table's rows as DuckDB reads them: the data files the scan plans, less the rows their position-delete
    files name (file_row_number is Iceberg's pos)."""
    import duckdb
    tasks = list(table.scan().plan_files())
    data = [t.file.file_path[len("file://"):] for t in tasks]
    deletes = sorted({d.file_path[len("file://"):] for t in tasks for d in t.delete_files})
    con = duckdb.connect()
    con.execute("CREATE TABLE dels (file_path VARCHAR, pos BIGINT)")
    if deletes:
        con.execute(f"INSERT INTO dels SELECT file_path, pos FROM read_parquet({deletes!r})")
    got = con.sql(f"SELECT * EXCLUDE (filename, file_row_number) FROM read_parquet({data!r}, filename=true, "
                      "file_row_number=true) r WHERE NOT EXISTS (SELECT 1 FROM dels d WHERE d.file_path = "
                      "'file://' || r.filename AND d.pos = r.file_row_number) ORDER BY id").to_arrow_table()
    return got.to_pylist()


def sha(url):
    return hashlib.sha256(open(url[len("file://"):], "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def three_days(tmp_path_factory):
    d = tmp_path_factory.mktemp("upsert")
    inputs = [write_jsonl(d / f"day{k}.jsonl", docs) for k, docs in enumerate(days(), 1)]
    wh = d / "wh"
    wh.mkdir()
    out = {"snapshots": [], "manifests": [], "files": [], "rebuilds": [], "summaries": []}
    for k, inp in enumerate(inputs, 1):
        args = upsert_argv(inp, str(d / f"day{k}"), TABLE, catalog(wh), delete_missing=k == 3)
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main([*args, *COMMON]) == 0
        out["summaries"].append(err.getvalue())
        t = table_of(wh)
        out["snapshots"].append([s.snapshot_id for s in t.snapshots()])
        out["manifests"].append(json.load(open(d / f"day{k}" / "manifest.json")))
        out["files"].append({f.file.file_path: sha(f.file.file_path) for f in t.scan().plan_files()})
        rebuild = d / f"rebuild{k}"          # a fresh table of a full run of the day's input (append mode)
        rebuild.mkdir()
        assert main(["--input", inp, "--input-format", "jsonl", "--id-field", "id", "--output",
                     str(d / f"full{k}"), "--format", "parquet", "--iceberg-table", TABLE, "--iceberg-catalog",
                     catalog(rebuild), *COMMON]) == 0
        out["rebuilds"].append(rows(table_of(rebuild)))
    out.update(dir=d, wh=wh, inputs=inputs)
    return out


@pytest.mark.slow
def test_each_day_the_table_equals_a_full_rebuild(three_days):
    t = table_of(three_days["wh"])
    assert rows(t) == three_days["rebuilds"][2]                   # pyiceberg: ids, tokens, every float
    target = IcebergTarget(TABLE, catalog(three_days["wh"]))
    assert same_rows(target, str(three_days["dir"] / "full3"))   # the full run's own shards, as a benchmark checks
    assert not same_rows(target, str(three_days["dir"] / "full2"))
    assert duckdb_rows(t) == three_days["rebuilds"][2]            # DuckDB over the planned files
    ids = {r["doc_id"] for r in rows(t)}
    assert "wiki-100" in ids and not {"wiki-004", "wiki-020"} & ids
    for k in (0, 1):      # time travel: the snapshot of day k + 1
        assert rows(t, three_days["snapshots"][k][-1]) == three_days["rebuilds"][k]


@pytest.mark.slow
def test_each_day_is_one_snapshot_and_a_rerun_adds_none(three_days, capsys):
    snaps = three_days["snapshots"]
    assert [len(s) for s in snaps] == [1, 2, 3]
    t = table_of(three_days["wh"])
    for k, inp in enumerate(three_days["inputs"], 1):
        capsys.readouterr()
        args = upsert_argv(inp, str(three_days["dir"] / f"day{k}"), TABLE, catalog(three_days["wh"]),
                           delete_missing=k == 3)
        assert main([*args, *COMMON]) == 0
        assert "already complete" in capsys.readouterr().err
    assert [s.snapshot_id for s in table_of(three_days["wh"]).snapshots()] == snaps[2]
    assert rows(table_of(three_days["wh"])) == rows(t)


@pytest.mark.slow
def test_unchanged_documents_are_neither_embedded_nor_rewritten(three_days):
    m1, m2, m3 = (m["counts"] for m in three_days["manifests"])
    assert (m1["documents_added"], m1["documents_unchanged"]) == (24, 0)
    assert (m2["documents_unchanged"], m2["documents_changed"], m2["documents_added"], m2["documents_removed"]) == \
        (21, 3, 0, 0)
    assert (m3["documents_unchanged"], m3["documents_changed"], m3["documents_added"], m3["documents_removed"]) == \
        (21, 1, 1, 2)
    for c in (m1, m2, m3):       # nothing lost: every document read is counted once
        assert c["documents"] == c["documents_unchanged"] + c["documents_changed"] + c["documents_added"]
    edited = [r for r in three_days["rebuilds"][1] if r["doc_id"] in ("wiki-002", "wiki-009", "wiki-017")]
    assert m2["sentences_written"] == len(edited) > 0          # only the edited documents were embedded
    # each removed row deleted once (wiki-009's day-1 rows, deleted on day 2, are not deleted again on day 3)
    r1, r2 = three_days["rebuilds"][:2]
    r1_removed = sum(r["doc_id"] in ("wiki-002", "wiki-009", "wiki-017") for r in r1)
    removed = r1_removed + sum(r["doc_id"] in ("wiki-009", "wiki-004", "wiki-020") for r in r2)
    summary = table_of(three_days["wh"]).current_snapshot().summary
    assert int(summary["total-position-deletes"]) == removed > 0
    assert f"upsert: 1 file added, {removed - r1_removed} rows deleted by" in three_days["summaries"][2]
    metrics = open(three_days["dir"] / "day3" / "metrics.prom").read()
    assert 'elmo_pipeline_documents_unchanged_total{' in metrics and "documents unchanged" in \
        open(three_days["dir"] / "day3" / "report.html").read()
    before, after = three_days["files"][0], three_days["files"][1]
    assert all(after[f] == h for f, h in before.items())          # day 1's file: still there, same bytes
    state = pq.read_table(three_days["dir"] / "day3" / "doc_hashes.parquet")
    live = state.filter(pc.not_equal(state.column("change"), "removed"))
    assert sorted(live.column("doc_id").to_pylist()) == sorted({r["doc_id"] for r in three_days["rebuilds"][2]})
    assert os.path.exists(three_days["dir"] / "day2" / "doc_hashes.parquet")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["register:1", "registered:1"])
def test_day_killed_around_its_commit_then_rerun_commits_once(point, three_days, tmp_path):
    from tests.resume_helpers import run_subprocess
    wh = tmp_path / "wh"
    wh.mkdir()
    day1, day2 = three_days["inputs"][:2]
    assert main([*upsert_argv(day1, str(tmp_path / "day1"), TABLE, catalog(wh)), *COMMON]) == 0
    args = [*upsert_argv(day2, str(tmp_path / "day2"), TABLE, catalog(wh)), *COMMON]
    p = run_subprocess(args, point)                       # SIGKILL just before / just after the commit
    assert p.returncode == -9, p.stderr[-2000:]
    assert len(table_of(wh).snapshots()) == (1 if point == "register:1" else 2)
    p = run_subprocess(args)                              # the same command finishes the finalize
    assert p.returncode == 0 and "finished the interrupted finalize" in p.stderr, p.stderr[-2000:]
    p = run_subprocess(args)
    assert p.returncode == 0 and "already complete" in p.stderr and "already registered" in p.stderr
    t = table_of(wh)
    assert len(t.snapshots()) == 2 and rows(t) == three_days["rebuilds"][1]


@pytest.mark.slow
def test_a_table_changed_since_the_comparison_is_refused(three_days, tmp_path):
    """Day 2 killed before its commit; day 3 commits meanwhile; rerun, day 2 finds the table moved since it
    compared and commits nothing (one line, exit 2); into a new --output it compares with day 3's table."""
    from tests.resume_helpers import run_subprocess
    wh = tmp_path / "wh"
    wh.mkdir()
    day1, day2, day3 = three_days["inputs"]
    assert main([*upsert_argv(day1, str(tmp_path / "day1"), TABLE, catalog(wh)), *COMMON]) == 0
    late = [*upsert_argv(day2, str(tmp_path / "late"), TABLE, catalog(wh)), *COMMON]
    assert run_subprocess(late, "register:1").returncode == -9
    assert main([*upsert_argv(day3, str(tmp_path / "day3"), TABLE, catalog(wh), delete_missing=True), *COMMON]) == 0
    p = run_subprocess(late)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and err[-1].startswith("error: ") and "changed since this run compared" in err[-1], err
    assert len(table_of(wh).snapshots()) == 2
    assert main([*upsert_argv(day2, str(tmp_path / "again"), TABLE, catalog(wh), delete_missing=False), *COMMON]) == 0
    t = table_of(wh)
    assert len(t.snapshots()) == 3
    # day 2's input upon day 3's table, without --delete-missing: day 2's documents, and day 3's addition kept
    assert sorted({r["doc_id"] for r in rows(t)}) == sorted({d for d, _ in days()[1]} | {"wiki-100"})


def test_the_upsert_commit_is_never_rebased_on_a_moved_table(tmp_path):
    """pyiceberg retries a conflicting commit on top of the new head; an upsert's snapshot (rows and deletes
    computed against the head it read) must fail instead."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.table import _parquet_files_to_data_files
    from pyiceberg.table.snapshots import Operation
    from elmo_pipeline.formats.iceberg.commit import _upsert_producer
    files = []
    for k in range(3):
        pq.write_table(pa.table({"id": [f"d{k}#0"], "doc_id": [f"d{k}"]}), tmp_path / f"f{k}.parquet")
        files.append(f"file://{tmp_path}/f{k}.parquet")
    cat = load_catalog("default", uri=catalog(tmp_path), warehouse=f"file://{tmp_path}")
    cat.create_namespace("elmo")
    t = cat.create_table(TABLE, schema=pa.schema([("id", pa.string()), ("doc_id", pa.string())]),
                         properties={"commit.retry.min-wait-ms": "1"})
    t.add_files(files[:1])
    stale = cat.load_table(TABLE)
    cat.load_table(TABLE).add_files(files[1:2])          # another writer moves the head
    with pytest.raises(CommitFailedException):
        with stale.transaction() as tx:
            with _upsert_producer()(operation=Operation.OVERWRITE, transaction=tx, io=stale.io) as producer:
                for f in _parquet_files_to_data_files(tx.table_metadata, files[2:], stale.io):
                    producer.append_data_file(f)
    assert len(cat.load_table(TABLE).snapshots()) == 2


@pytest.mark.slow
def test_the_same_command_into_another_output_leaves_earlier_snapshots_whole(three_days, tmp_path):
    """Day 2's command run again later into another --output (the same run key): its delete files are its own,
    so day 2's snapshot, still current for the rows it deleted, reads as before."""
    wh = tmp_path / "wh"
    wh.mkdir()
    day1, day2, day3 = three_days["inputs"]
    for k, (inp, out) in enumerate(((day1, "day1"), (day2, "day2"), (day3, "day3"), (day2, "day2-again"))):
        assert main([*upsert_argv(inp, str(tmp_path / out), TABLE, catalog(wh), delete_missing=k == 2), *COMMON]) == 0
    t = table_of(wh)
    assert rows(t, t.snapshots()[1].snapshot_id) == three_days["rebuilds"][1]
    got = rows(t)
    assert sorted({r["doc_id"] for r in got}) == sorted({d for d, _ in days()[1]} | {"wiki-100"})
    assert len({r["id"] for r in got}) == len(got)          # no sentence twice
    assert [r for r in got if r["doc_id"] != "wiki-100"] == three_days["rebuilds"][1]


@pytest.mark.slow
def test_reuse_table_embeds_only_the_new_sentences_and_the_table_equals_a_full_rebuild(three_days, tmp_path):
    """--reuse-table: each day's changed documents take the vectors of their sentences that an output registered
    in the table holds; only sentences of new keys are embedded, and the table equals a full rebuild, bit for
    bit."""
    wh = tmp_path / "wh"
    wh.mkdir()
    manifests = []
    for k, inp in enumerate(three_days["inputs"], 1):
        args = upsert_argv(inp, str(tmp_path / f"day{k}"), TABLE, catalog(wh), delete_missing=k == 3)
        assert main([*args, *COMMON, "--reuse-table"]) == 0
        manifests.append(json.load(open(tmp_path / f"day{k}" / "manifest.json")))
        assert rows(table_of(wh)) == three_days["rebuilds"][k - 1]
    assert same_rows(IcebergTarget(TABLE, catalog(wh)), str(three_days["dir"] / "full3"))
    day1 = f"file://{tmp_path}/day1"
    assert manifests[0]["counts"].get("sentences_reused", 0) == 0      # an empty table: nothing to reuse
    assert manifests[1]["reuse"]["sources"] == [day1]
    assert manifests[2]["reuse"]["sources"] == [day1, f"file://{tmp_path}/day2"]
    before = {tuple(r["tokens"]) for r in three_days["rebuilds"][0]}
    for k in (1, 2):
        c, written = manifests[k]["counts"], upserted_rows(three_days, k)
        new = {tuple(r["tokens"]) for r in written} - before
        assert c["sentences_written"] == len(written) > 0
        assert c["sentences_embedded"] == len(new)           # one per new key (--dedupe writes its copies)
        assert c["sentences_reused"] == sum(tuple(r["tokens"]) in before for r in written) > 0
        assert sum(c["sentences_reused_by_source"].values()) == c["sentences_reused"]
        before |= {tuple(r["tokens"]) for r in three_days["rebuilds"][k]}
    assert manifests[1]["counts"]["sentences_reused_by_source"] == {day1: manifests[1]["counts"]["sentences_reused"]}


def upserted_rows(three_days, k):
    """The full rebuild's rows of the new and changed documents of day k + 1: what that day's upsert writes."""
    old = dict(days()[k - 1])
    changed = {d for d, t in days()[k] if old.get(d) != t}
    return [r for r in three_days["rebuilds"][k] if r["doc_id"] in changed]


@pytest.mark.slow
def test_reuse_table_leaves_out_another_models_output_and_refuses_a_missing_one(tmp_path, capsys, caplog):
    """A table may mix runs: an output registered there by another model or vector settings is left out with
    a logged line; a registered output gone from its folder is one error line (exit 2)."""
    docs = days()[0][:6]
    wh = tmp_path / "wh"
    wh.mkdir()
    table = ["--iceberg-table", TABLE, "--iceberg-catalog", catalog(wh), "--input-format", "jsonl", "--id-field",
             "id", "--format", "parquet", "--torch-threads", "1", "--progress", "off"]
    for name, extra in (("ours", ["--batch-invariant"]), ("theirs", ["--no-batch-invariant"])):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", [(f"{name}-{i}", t) for i, t in docs])
        assert main(["--input", inp, "--output", str(tmp_path / name), *table, *extra]) == 0
    inp = write_jsonl(tmp_path / "later.jsonl", [(f"later-{i}", t) for i, t in docs])
    capsys.readouterr()
    assert main(["--input", inp, "--output", str(tmp_path / "later"), *table, "--batch-invariant",
                 "--reuse-table"]) == 0
    assert f"not reused: --reuse-table ({TABLE}) file://{tmp_path}/theirs: written by another model" in caplog.text
    c = json.load(open(tmp_path / "later" / "manifest.json"))["counts"]
    assert c["sentences_embedded"] == 0 and c["sentences_reused_by_source"] == \
        {f"file://{tmp_path}/ours": c["sentences_written"]}
    os.remove(tmp_path / "ours" / "manifest.json")
    inp = write_jsonl(tmp_path / "again.jsonl", [(f"again-{i}", t) for i, t in docs])
    assert main(["--input", inp, "--output", str(tmp_path / "again"), *table, "--batch-invariant",
                 "--reuse-table"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: --reuse-table ({TABLE}) file://{tmp_path}/ours: no finished output there"), last


@pytest.mark.slow
def test_plan_of_a_day_counts_the_unchanged_documents_and_times_only_the_rest(tmp_path):
    """`plan` of day 2 against the table day 1 made: the sample (the whole small input) compared with the table's
    state gives the real day-2 run's counts exactly: documents unchanged, changed, added, removed, and the
    sentences and tokens embedded (those of the changed and added documents: far fewer than a full run's)."""
    from elmo_pipeline.pipeline.dry_run import estimate, render
    day1, day2, _ = days()
    day2 = [d for d in day2 if d[0] != "wiki-004"] + [("wiki-100", day1[4][1] + " A new one .")]
    wh = tmp_path / "wh"
    wh.mkdir()
    inputs = [write_jsonl(tmp_path / f"day{k}.jsonl", docs) for k, docs in ((1, day1), (2, day2))]
    args = [[*upsert_argv(inp, str(tmp_path / f"day{k}"), TABLE, catalog(wh)), *COMMON]
            for k, inp in enumerate(inputs, 1)]
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(args[0]) == 0
    full = json.load(open(tmp_path / "day1" / "manifest.json"))["counts"]
    snapshots = [s.snapshot_id for s in table_of(wh).snapshots()]
    plan = estimate(args[1])
    assert not os.path.exists(tmp_path / "day2") and [s.snapshot_id for s in table_of(wh).snapshots()] == snapshots
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(args[1]) == 0
    real = json.load(open(tmp_path / "day2" / "manifest.json"))["counts"]
    u, e = plan["upsert"], plan["estimated"]
    assert plan["sample"]["documents"] == len(day2) == real["documents"]        # the sample is the whole input
    assert (u["documents_unchanged"], u["documents_changed"], u["documents_added"], u["documents_removed"]) == \
        (real["documents_unchanged"], real["documents_changed"], real["documents_added"], real["documents_removed"]) \
        == (20, 3, 1, 1)
    assert (e["sentences_written"], e["tokens_written"]) == (real["sentences_written"], real["tokens_written"])
    assert 0 < e["tokens_written"] < 0.3 * full["tokens_written"]
    assert plan["seconds"]["embed"] == pytest.approx(e["tokens_written"] / plan["rate"]["tokens_per_s"])
    text = render(plan)
    assert "about 20 documents unchanged (not embedded), 3 changed, 1 added, 1 of the table's removed" in text
    print(text, {k: (e[k], real[k], full[k]) for k in ("sentences_written", "tokens_written")})
    u["documents_removed"] = None          # a sample of part of the input: the run counts them
    assert "removed) are known at run time" in render(plan)


@pytest.mark.slow
def test_a_state_file_replaced_by_an_older_one_is_refused(three_days, tmp_path, capsys):
    """Day 2's doc_hashes.parquet replaced by day 1's (a restore, a copy between day folders): day 3 refuses it,
    one line, nothing committed (its snapshot recorded the state file's size and SHA-256), never a duplicate."""
    import shutil
    wh = tmp_path / "wh"
    wh.mkdir()
    day1, day2, day3 = three_days["inputs"]
    for k, inp in ((1, day1), (2, day2)):
        assert main([*upsert_argv(inp, str(tmp_path / f"day{k}"), TABLE, catalog(wh)), *COMMON]) == 0
    shutil.copy(tmp_path / "day1" / "doc_hashes.parquet", tmp_path / "day2" / "doc_hashes.parquet")
    capsys.readouterr()
    assert main([*upsert_argv(day3, str(tmp_path / "day3"), TABLE, catalog(wh)), *COMMON]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "is not the file its snapshot recorded" in err[-1], err
    assert len(table_of(wh).snapshots()) == 2


@pytest.mark.slow
def test_a_registered_day_whose_manifest_lost_its_records_stays_complete(three_days, tmp_path, capsys):
    """A finished, registered day whose manifest.json lost `files` (edited): the same command again is still
    'already complete' (its registration is found before any record is read), nothing committed."""
    wh = tmp_path / "wh"
    wh.mkdir()
    args = [*upsert_argv(three_days["inputs"][0], str(tmp_path / "day1"), TABLE, catalog(wh)), *COMMON]
    assert main(args) == 0
    m = json.load(open(tmp_path / "day1" / "manifest.json"))
    del m["files"]
    json.dump(m, open(tmp_path / "day1" / "manifest.json", "w"))
    capsys.readouterr()
    assert main(args) == 0
    assert "already complete" in capsys.readouterr().err
    assert len(table_of(wh).snapshots()) == 1


@pytest.mark.slow
def test_a_document_with_a_sentence_that_failed_to_embed_is_embedded_again(tmp_path, monkeypatch):
    """A sentence fails to embed (a transient error: a dead letter) on day 1: its document is not recorded as
    current, so day 2 (same input, the failure gone) embeds it again and the table holds every sentence."""
    from elmo_pipeline.model.embedder import ElmoEmbedder
    wh = tmp_path / "wh"
    wh.mkdir()
    docs = [(f"d{i}", f"The cat {i} sat . It was glad {i} .") for i in range(6)]
    docs[3] = ("d3", "The dog sat . It was BOOMING here .")
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    real = ElmoEmbedder.embed_packed

    def failing(self, sentences, *a, **k):
        if any("BOOMING" in s for s in sentences):
            raise MemoryError("transient")
        return real(self, sentences, *a, **k)
    monkeypatch.setattr(ElmoEmbedder, "embed_packed", failing)
    assert main([*upsert_argv(inp, str(tmp_path / "day1"), TABLE, catalog(wh)), *COMMON, "--direct_num_workers",
                 "1"]) == 0
    m1 = json.load(open(tmp_path / "day1" / "manifest.json"))
    assert m1["counts"]["dead_letter_sentences"] == 1
    state = pq.read_table(tmp_path / "day1" / "doc_hashes.parquet").to_pylist()
    assert {r["doc_id"]: r["doc_hash"] for r in state}["d3"] == "incomplete"
    monkeypatch.setattr(ElmoEmbedder, "embed_packed", real)
    assert main([*upsert_argv(inp, str(tmp_path / "day2"), TABLE, catalog(wh)), *COMMON]) == 0
    m2 = json.load(open(tmp_path / "day2" / "manifest.json"))
    assert (m2["counts"]["documents_changed"], m2["counts"]["documents_unchanged"]) == (1, 5)
    got = rows(table_of(wh))
    assert len(got) == 12 and len({r["id"] for r in got}) == 12


@pytest.mark.slow
def test_the_duplicate_id_check_runs_before_an_upsert_commit(three_days):
    """check_new_ids, as an upsert commit calls it: the ids of day 1's rows are refused against the table after
    day 3 (its live rows hold most of them), unless every document they belong to is replaced in the same commit."""
    from elmo_pipeline.formats.iceberg import data_file_urls, output_url
    from elmo_pipeline.formats.iceberg.commit import DuplicateIdError, check_new_ids, run_ids
    table = table_of(three_days["wh"])
    day1 = str(three_days["dir"] / "day1")
    ids = run_ids(table.io, data_file_urls(day1, three_days["manifests"][0]))
    with pytest.raises(DuplicateIdError, match="already holds"):
        check_new_ids(table, ids, output_url(day1))
    docs = pa.array(sorted({i.rpartition("#")[0] for i in ids.to_pylist()}))
    check_new_ids(table, ids, output_url(day1), replaced=docs)
    with pytest.raises(DuplicateIdError, match="already holds"):
        check_new_ids(table, ids, output_url(day1), replaced=docs[1:])


@pytest.mark.slow
def test_unchanged_rows_of_another_kernel_path_are_refused_unless_asked(tmp_path, capsys, monkeypatch):
    """Day 1 computed with another LSTM loop (ELMO_LSTM_GEMM=bmm): day 2's upsert would leave its unchanged rows,
    other bits under the same key, so it refuses (exit 2, one line naming the difference and the flag, nothing
    committed) unless --reuse-across-kernels, whose manifest says so; the snapshot records each day's path."""
    wh = tmp_path / "wh"
    wh.mkdir()
    docs = [(f"d{i}", f"The cat {i} sat . It was glad {i} .") for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    monkeypatch.setenv("ELMO_LSTM_GEMM", "bmm")
    assert main([*upsert_argv(inp, str(tmp_path / "day1"), TABLE, catalog(wh)), *COMMON]) == 0
    monkeypatch.delenv("ELMO_LSTM_GEMM")
    recorded = json.loads(table_of(wh).current_snapshot().summary.additional_properties["elmo-pipeline.kernel-path"])
    assert recorded["lstm_loop"][0] == "bmm"
    capsys.readouterr()
    assert main([*upsert_argv(inp, str(tmp_path / "day2"), TABLE, catalog(wh)), *COMMON]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --iceberg-mode upsert Iceberg table {TABLE}: computed on another kernel path "
                              "(LSTM loop bmm") and "--reuse-across-kernels" in err[-1], err
    assert len(table_of(wh).snapshots()) == 1
    assert main([*upsert_argv(inp, str(tmp_path / "day2"), TABLE, catalog(wh)), *COMMON,
                 "--reuse-across-kernels"]) == 0
    m = json.load(open(tmp_path / "day2" / "manifest.json"))
    assert m["upsert"]["kernel_path"].startswith("differs: LSTM loop bmm")


def test_delete_missing_removes_nothing_while_an_input_file_cannot_be_read_whole(tiny_model_files, tmp_path, caplog):
    """--delete-missing on a day whose .gz input is cut short (copied in while the run read it, a partial upload):
    its records past the cut are one dead letter "unreadable file", their ids unknown. They were removed from the
    table as documents gone from the corpus (exit 0); now the table's documents not in the input are kept that day
    (documents_kept), and the next day, the file whole again, finds them all unchanged."""
    import gzip
    options, weights = tiny_model_files
    model = ("--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "off")
    docs = [{"id": f"doc{k}", "text": f"The {k} boats came in over the tide ."} for k in range(12)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:3]))
    whole = gzip.compress("".join(json.dumps(d) + "\n" for d in docs[3:]).encode())
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(whole)
    day = lambda name: [*upsert_argv(f"{tmp_path}/in/*", str(tmp_path / name), TABLE, catalog(tmp_path)), *model]
    assert main(day("day1")) == 0
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    from elmo_pipeline.pipeline.dry_run import estimate
    assert estimate(day("day2"))["upsert"]["documents_removed"] == 0        # the plan says what the run does
    assert main(day("day2")) == 0
    assert "kept this run, not removed" in caplog.text
    counts = json.load(open(tmp_path / "day2" / "manifest.json"))["counts"]
    assert (counts["documents_removed"], counts["documents_kept"]) == (0, 9)
    assert sorted({r["doc_id"] for r in rows(table_of(tmp_path))}) == sorted(d["id"] for d in docs)
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(whole)
    assert main(day("day3")) == 0
    counts = json.load(open(tmp_path / "day3" / "manifest.json"))["counts"]
    assert (counts["documents_unchanged"], counts["documents_removed"], counts["documents_added"]) == (12, 0, 0)


def test_a_document_state_replaced_by_a_fifo_is_refused_not_waited_on(tiny_model_files, tmp_path):
    """The table's current state file (the last day's doc_hashes.parquet) replaced by a FIFO: the next day's planning
    opened it and waited for a writer for good (a scheduled job that never ends); now it is no regular file, refused
    unopened: one line, exit 2, nothing written."""
    import threading
    options, weights = tiny_model_files
    model = ("--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "off")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": f"d{k}", "text": f"Boat {k} came ."}) + "\n"
                                              for k in range(3)))
    day = lambda name: [*upsert_argv(str(tmp_path / "a.jsonl"), str(tmp_path / name), TABLE, catalog(tmp_path)),
                        *model]
    assert main(day("day1")) == 0
    state = tmp_path / "day1" / "doc_hashes.parquet"
    os.remove(state)
    os.mkfifo(state)
    got = {}
    t = threading.Thread(target=lambda: got.update(code=main(day("day2"))), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        with open(state, "wb"):          # let the blocked reader go
            pass
        t.join(30)
        pytest.fail("planning blocked on the FIFO")
    assert got["code"] == 2 and not os.path.exists(tmp_path / "day2")
