"""Ownership of the output folder: the pipeline deletes or replaces only what it can show it wrote (its
manifest's files, its finalize plans' moves, _staging/, the lease and its own temporary files). A run into a
folder of unknown files refuses before touching anything; --overwrite leaves unknown files alone, but unknown
files where the output goes (the shard folders readers glob, the final names) refuse even then; an input
inside --output is refused at planning. Finalize is fenced by the lease: a run paused past the stale age
while another run finished the output exits 75 and changes nothing more. Real files, moto's S3 server on
loopback, real `python -m elmo_pipeline.pipeline.run` processes."""
import glob
import json
import os
import signal
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.output.lease import RetryLater
from elmo_pipeline.pipeline.run import main
from tests.pipeline_helpers import moto_s3
from tests.resume_helpers import (SMALL, argv, assert_same_output, corpus, read_output,  # noqa: F401 (fixtures)
                                  reference, run_subprocess)
from tests.test_concurrent_runs import _snapshot, _start, _wait_for
from tests.test_crash_resume import _stage
from elmo_pipeline.output import state as resume
from elmo_pipeline.output.finalize import finalize, plan_from_staging
from elmo_pipeline.output.staging import Staging


def _ingredients(layers="all"):
    ing = {"version": 1, "inputs": [], "options": {"layers": layers}, "model": {}}
    return ing, resume.run_key(ing)


def _contents(root):
    """{relative path: sha256} of every file under root."""
    return {p: digest for p, (digest, _) in _snapshot(root).items()}


def _plant(root, names):
    """Files of unknown origin (each holding its own name) under root."""
    for rel in names:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(f"planted {rel}\n")


def _finished(out, key, fence=None, register=None):
    """A finished output of run key `key` (2 shards, through prepare_output and finalize)."""
    ing = {"version": 1, "inputs": [], "options": {"key": key}, "model": {}}
    state = resume.prepare_output(out, key, ing, False)
    st = state.staging
    _stage(st, ["d:1#0", "d:1#1"])
    _stage(st, ["d:2#0"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    hooks = {k: v for k, v in (("register", register), ("fence", fence)) if v is not None}
    return finalize(out, st, plan_from_staging(st, ["d"]), {"run": {"key": key}}, **hooks)


def test_a_folder_of_unknown_files_is_refused_and_overwrite_writes_beside_them(tmp_path):
    ing, key = _ingredients()
    assert resume.prepare_output(str(tmp_path / "missing"), key, ing, False).action == "fresh"
    (tmp_path / "empty").mkdir()
    assert resume.prepare_output(str(tmp_path / "empty"), key, ing, False).action == "fresh"
    out = str(tmp_path / "out")
    _plant(out, ["notes.txt", "extra/data.csv"])
    before = _contents(out)
    with pytest.raises(FileExistsError, match=r"holds no run of this pipeline: extra/, notes.txt\. Choose") as e:
        resume.prepare_output(out, key, ing, False)
    assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    assert _contents(out) == before and sorted(os.listdir(out)) == ["extra", "notes.txt"]
    assert resume.prepare_output(out, key, ing, True).action == "fresh"        # written beside them
    assert {k: v for k, v in _contents(out).items() if not k.startswith("_staging")} == before


def test_unknown_files_where_the_output_goes_refuse_even_with_overwrite(tmp_path):
    """Readers glob parquet/, hdf5/, dead_letters/: an unknown file there would join the output, so even
    --overwrite refuses, naming three of them; once they are gone, --overwrite replaces the pipeline's own
    output and leaves the unknown files elsewhere alone."""
    out = str(tmp_path / "out")
    _finished(out, "k1")
    ours = _contents(out)
    assert any(k.startswith("parquet/") for k in ours) and "manifest.json" in ours
    planted = ["parquet/keep.parquet", "hdf5/my_vectors.h5", "dead_letters/a.txt", "dead_letters/b.txt",
               "dead_letters/c.txt"]
    _plant(out, planted + ["notes.txt", "docs/readme.md"])
    before = _contents(out)
    ing, key = _ingredients("top")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as e:
            resume.prepare_output(out, key, ing, overwrite)
        assert str(e.value).startswith(f"{out} holds 5 file(s) this pipeline did not write where its output goes: "
                                       "dead_letters/a.txt, dead_letters/b.txt, dead_letters/c.txt and 2 more.")
        assert _contents(out) == before
    for rel in planted:
        os.remove(os.path.join(out, rel))
    assert resume.prepare_output(out, key, ing, True).action == "fresh"
    left = _contents(out)
    assert {k for k in left if not k.startswith("_staging/")} == {"notes.txt", "docs/readme.md"}
    assert all(left[k] == before[k] for k in ("notes.txt", "docs/readme.md"))


@pytest.mark.parametrize("name,change", [("parquet", "a byte"), ("parquet", "another file"), ("hdf5", "a byte"),
                                         ("report.html", "another file")])
def test_a_listed_file_written_over_since_is_not_deleted_by_overwrite(tmp_path, name, change):
    """A file at a name the finished output's manifest lists, written over since (a byte changed at its size, or
    another file of another size), is no longer the pipeline's: --overwrite exits 2 naming it before it removes
    anything, every file as it was; once it is moved away, --overwrite clears the rest and starts over."""
    out = str(tmp_path / "out")
    m = _finished(out, "k1")
    rel = m["shards"][0][name] if name in ("parquet", "hdf5") else name
    path = os.path.join(out, rel)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:50] + bytes([data[50] ^ 1]) + data[51:] if change == "a byte" else b"<p>my own page</p>")
    before = _contents(out)
    ing, key = _ingredients("top")
    with pytest.raises(FileExistsError, match=f"{rel}: a file this pipeline did not write is there"):
        resume.prepare_output(out, key, ing, True)
    assert _contents(out) == before
    os.remove(path)
    assert resume.prepare_output(out, key, ing, True).action == "fresh"
    assert {k for k in _contents(out) if not k.startswith("_staging/")} == set()


@pytest.mark.parametrize("name", ["manifest.json", "_SUCCESS"])
def test_a_top_file_placed_just_before_finalize_writes_it_is_never_replaced(tmp_path, monkeypatch, name):
    """manifest.json placed after Finalize looked for one (and before it wrote its own), or _SUCCESS placed while
    the run registered its output: it was replaced (a user's file lost, exit 0). Now the write never goes over a
    file there: exit 2 naming it, the file as it was."""
    from elmo_pipeline.output import manifest as manifests
    out = str(tmp_path / "out")
    placed = json.dumps({"my": "own " + name}).encode()

    def place():
        with open(os.path.join(out, name), "wb") as f:
            f.write(placed)
    real = manifests.write
    if name == "manifest.json":
        monkeypatch.setattr(manifests, "write", lambda *a, **k: (place(), real(*a, **k)))
    with pytest.raises(FileExistsError, match=f"{name}: a file this pipeline did not write is there"):
        _finished(out, "k1", register=(lambda manifest, fence: place()) if name == "_SUCCESS" else None)
    assert open(os.path.join(out, name), "rb").read() == placed
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


@pytest.mark.parametrize("name,content", [("manifest.json", '{"my": "own manifest"}'), ("manifest.json", "not json"),
                                          ("_SUCCESS", ""), ("report.html", "<p>mine</p>"), ("metrics.prom", "x 1\n")])
def test_a_file_at_a_final_name_that_no_manifest_of_ours_lists_is_in_the_way(tmp_path, name, content):
    out = str(tmp_path / "out")
    os.makedirs(out)
    with open(os.path.join(out, name), "w") as f:
        f.write(content)
    ing, key = _ingredients()
    with pytest.raises(FileExistsError, match=f"did not write where its output goes: {name}"):
        resume.prepare_output(out, key, ing, True)
    assert open(os.path.join(out, name)).read() == content


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_doc_hashes_file_no_manifest_lists_is_in_an_upserts_way_only(tmp_path, overwrite):
    """output/ownership.py foreign_files(writes_state): a doc_hashes.parquet that no manifest or plan of the output
    lists (a user's file, or an earlier upsert's state an older snapshot names) is refused by an upsert run, which
    would move its own state onto it, with --overwrite too; another run leaves it alone beside its output."""
    out = str(tmp_path / "out")
    _plant(out, ["doc_hashes.parquet", "notes.txt"])
    before = _contents(out)
    ing, key = _ingredients()
    with pytest.raises(FileExistsError, match="did not write where its output goes: doc_hashes.parquet"):
        resume.prepare_output(out, key, ing, overwrite, writes_state=True)
    assert _contents(out) == before
    assert resume.prepare_output(out, key, ing, True).action == "fresh"
    assert {k: v for k, v in _contents(out).items() if not k.startswith("_staging")} == before


def test_a_finalize_cut_short_by_a_lost_lease_is_cleared_through_its_plan(tmp_path):
    """A fence that fails once 3 files are moved: Finalize stops at once (RetryLater), nothing more is
    moved, no manifest or _SUCCESS. Another command refuses that output without --overwrite; with it, the moved
    files go (its plan shows they are the pipeline's) and an unknown file beside them stays."""
    out = str(tmp_path / "out")

    def fence():                      # the lease is lost once three files have their final names
        if len(glob.glob(os.path.join(out, "*", "part-*"))) == 3:
            raise RetryLater("lost the lease")
    with pytest.raises(RetryLater):
        _finished(out, "k1", fence)
    moved = sorted(glob.glob(os.path.join(out, "*", "part-*")))
    assert len(moved) == 3 and not os.path.exists(os.path.join(out, "manifest.json"))
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    _plant(out, ["notes.txt"])
    ing, key = _ingredients("top")
    with pytest.raises(FileExistsError, match="unfinished run of a different command"):
        resume.prepare_output(out, key, ing, False)
    assert sorted(glob.glob(os.path.join(out, "*", "part-*"))) == moved
    assert resume.prepare_output(out, key, ing, True).action == "fresh"
    assert glob.glob(os.path.join(out, "*", "part-*")) == [] and os.listdir(os.path.join(out, "_staging")) == [key]
    assert open(os.path.join(out, "notes.txt")).read() == "planted notes.txt\n"


def test_finalize_checks_the_fence_before_each_irreversible_step(tmp_path):
    """The plan, every move, the manifest, the staging removal, the register hook and _SUCCESS each come after a
    fence check that passed: a fence failing at any of its checks leaves the step it guards undone."""
    out = str(tmp_path / "out")
    seen = []
    _finished(out, "k1", fence=lambda: seen.append(sorted(os.listdir(out))), register=lambda m, fence: seen.append("register"))
    # the staged report and metrics.prom, the plan; 6 moves (2 shards x 2 formats, the report, metrics.prom);
    # the manifest; the staging folder's removal and its parent's; the register hook (then the hook itself);
    # _SUCCESS
    assert len(seen) == 3 + 6 + 1 + 2 + 2 + 1 and seen[-2] == "register" and "_SUCCESS" not in seen[-1]
    for point in range(1, len(seen)):
        other = str(tmp_path / f"out{point}")
        calls, registered = [], []

        def fence():
            calls.append(1)
            if len(calls) == point:
                raise RetryLater("lost")
        with pytest.raises(RetryLater):
            _finished(other, "k1", fence, register=lambda m, fence: registered.append(m))
        assert not os.path.exists(os.path.join(other, "_SUCCESS")) and (point > 13) == bool(registered)
        assert len(glob.glob(os.path.join(other, "*", "part-*"))) == max(0, min(point - 4, 4))
        assert os.path.exists(os.path.join(other, "manifest.json")) == (point > 10)
        assert os.path.exists(os.path.join(other, "_staging")) == (point <= 12)


def test_a_run_that_lost_its_lease_before_preparing_the_output_removes_nothing(tmp_path):
    """A run paused right after taking the lease, past the stale age, while another run took it over and finished
    the output: resumed, its preparation (--overwrite's clearing, a resume's removal of staged leftovers) is fenced
    like Finalize, so it exits 75 (RetryLater) and the finished output stays whole."""
    from elmo_pipeline.output import lifecycle
    out, unfinished = str(tmp_path / "out"), str(tmp_path / "unfinished")
    _finished(out, "k1")
    ing2 = {"version": 1, "inputs": [], "options": {"key": "k2"}, "model": {}}
    resume.prepare_output(unfinished, "k2", ing2, False)
    _stage(os.path.join(unfinished, "_staging", "k2"), ["d:1#0"])
    _plant(unfinished, ["_staging/k2/0123456789abcdef0123456789abcdef.parquet"])    # a shard without its record
    ing, key = _ingredients("top")

    def lost():
        raise RetryLater("lost the lease")
    for folder, overwrite, k, i in ((out, True, key, ing), (unfinished, False, "k2", ing2)):
        before = _contents(folder)
        job = lifecycle.Job(folder, k, i, {}, [], None, overwrite=overwrite)
        with pytest.raises(RetryLater):
            lifecycle.rounds(job, lambda state: pytest.fail("the graph ran"), lost)
        assert _contents(folder) == before


def test_an_input_inside_the_output_is_refused(tmp_path):
    from elmo_pipeline.pipeline.validate import check_inputs_outside_output
    out = tmp_path / "out"
    (out / "parquet").mkdir(parents=True)
    (tmp_path / "link").symlink_to(out)
    for inside in (str(out / "parquet" / "keep.parquet"), str(tmp_path / "link" / "a.txt"),
                   str(tmp_path / "elsewhere" / ".." / "out" / "b.txt"), f"file://{out}/c.txt"):
        with pytest.raises(ValueError, match=f"lies inside --output {out}"):
            check_inputs_outside_output(["/data/x.txt", inside], str(out))
    with pytest.raises(ValueError, match="s3://b/out/p/x.parquet and 1 more lies inside --output s3://b/out/"):
        check_inputs_outside_output(["s3://b/out/p/x.parquet", "s3://b/out/y.txt"], "s3://b/out/")
    check_inputs_outside_output([str(tmp_path / "out-2" / "a.txt"), str(tmp_path / "a.txt"), "s3://b/outer/x",
                                 "gs://b/out/x"], str(out))
    check_inputs_outside_output(["s3://b/outer/x", "s3://c/out/x"], "s3://b/out")


# ---- real processes and an S3 server -----------------------------------------------------------------

ROW1 = ["parquet/keep.parquet", "dead_letters/notes.txt", "hdf5/my_vectors.h5", "report.html", "metrics.prom"]


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow   # real processes
def test_a_run_into_a_folder_of_unknown_files_exits_2_and_deletes_none(corpus, tiny_model_files, tmp_path):
    """Row 1: --output holding files that never were an output of the pipeline (no manifest, no staging, no
    lease): exit 2 with one line naming three of them, with and without --overwrite; every file byte-identical
    and nothing added."""
    out = str(tmp_path / "D")
    _plant(out, ROW1)
    before = _contents(out)
    for extra in ((), ("--overwrite",)):
        p = run_subprocess(argv(tiny_model_files, corpus, out, *extra))
        assert p.returncode == 2, p.stderr[-2000:]
        (line,) = _error_lines(p.stderr)
        assert f"{out} holds 5 file(s) this pipeline did not write where its output goes: dead_letters/notes.txt, " \
               "hdf5/my_vectors.h5, metrics.prom and 2 more" in line and line.endswith("(exit 2: fix the command)")
        assert "Traceback" not in p.stderr
        assert _contents(out) == before


@pytest.mark.slow   # real processes
def test_an_input_inside_the_output_exits_2_before_anything_is_deleted(tiny_model_files, tmp_path):
    """Row 2: --input 'D/parquet/*.parquet' --input-format parquet --output D: refused at planning (exit 2),
    the input still there byte for byte (with --overwrite too)."""
    out = str(tmp_path / "D")
    os.makedirs(os.path.join(out, "parquet"))
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["One sentence.", "Two more words here."]}),
                   os.path.join(out, "parquet", "keep.parquet"))
    before = _contents(out)
    for extra in ((), ("--overwrite",)):
        p = run_subprocess(argv(tiny_model_files, os.path.join(out, "parquet", "*.parquet"), out,
                                "--input-format", "parquet", *extra))
        assert p.returncode == 2, p.stderr[-2000:]
        (line,) = _error_lines(p.stderr)
        assert f"--input {out}/parquet/keep.parquet lies inside --output {out}" in line, line
        assert _contents(out) == before


@pytest.mark.slow   # real processes
@pytest.mark.parametrize("body", [b'{"heartbeat": "abc"}', b"[]", b'{"heartbeat": null}',
                                  b'{"heartbeat": 1e20, "token": "t", "host": "h", "pid": 1, "start": 0}'],
                         ids=["abc", "list", "null", "future"])
def test_a_damaged_lease_exits_75_while_fresh_and_is_taken_over_once_old(body, corpus, tiny_model_files, tmp_path):
    """Row 9: an edited _lease.json is never a crash (70) nor a lock forever (75): retry later while the object
    is fresh, taken over once its modification time is older than --lease-stale-seconds."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    lease = os.path.join(out, "_lease.json")
    with open(lease, "wb") as f:
        f.write(body)
    args = argv(tiny_model_files, corpus, out, *SMALL, "--lease-stale-seconds", "30")
    fresh = run_subprocess(args)
    assert fresh.returncode == 75, fresh.stderr[-2000:]
    assert "error:" in fresh.stderr and "older than 30 s (--lease-stale-seconds)" in fresh.stderr
    old = time.time() - 60
    os.utime(lease, (old, old))
    late = run_subprocess(args)
    assert late.returncode == 0, late.stderr[-2000:]
    assert "took over a stale lease" in late.stderr
    read_output(out)
    assert not os.path.exists(lease)


def _pause_in_finalize_witness(out, point):
    if point == "finalize_manifest":
        return lambda: os.path.exists(os.path.join(out, "manifest.json"))
    return lambda: bool(glob.glob(os.path.join(out, "*", "part-*")))


@pytest.mark.slow   # real processes, SIGSTOP
@pytest.mark.parametrize("point", ["finalize_move", "finalize_manifest"])
def test_a_run_paused_in_finalize_past_the_stale_age_exits_75_and_changes_nothing(point, corpus, tiny_model_files,
                                                                                 reference, tmp_path):
    """A run is stopped (SIGSTOP: its heartbeat thread too) in Finalize, after its first move or after writing
    the manifest; once its lease is stale a second run of the same command takes it over and finishes the
    output. The first, continued (SIGCONT), finds its lease gone before its next step: exit 75, and not one byte
    or mtime of the finished output changes (no move, no manifest, no _SUCCESS rewritten)."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL, "--lease-stale-seconds", "2")
    first = _start(args, delay=f"{point}:5")
    stopped = False
    try:
        _wait_for(_pause_in_finalize_witness(out, point), timeout=180, what=f"the first run at {point}")
        os.kill(first.pid, signal.SIGSTOP)
        stopped = True
        time.sleep(3)               # past the stale age: no heartbeat while stopped
        second = run_subprocess(args)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "took over a stale lease" in second.stderr and "finished the interrupted finalize" in second.stderr
        finished = read_output(out)
        assert_same_output(finished, reference)
        snapshot = _snapshot(out)
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 75, err[-2000:]
    (line,) = _error_lines(err)
    assert "lost the lease" in line and "changed nothing more" in line
    assert _snapshot(out) == snapshot


@pytest.mark.slow   # a moto S3 server
def test_on_s3_unknown_objects_refuse_and_overwrite_leaves_the_others_alone(corpus, tiny_model_files):
    """The same rules on s3:// (moto): an unknown object in the shard folders refuses even --overwrite and is
    kept; an unknown object elsewhere is left alone by --overwrite, which replaces only the pipeline's output."""
    with moto_s3("elmo-own") as (endpoint, fs):
        fs.put_file(corpus, "elmo-own/in/docs.txt")
        s3 = ("--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing")
        out = "s3://elmo-own/out"

        def args(*extra):
            return argv(tiny_model_files, "s3://elmo-own/in/docs.txt", out, *SMALL, *s3, *extra)
        fs.pipe_file("elmo-own/out/notes.txt", b"mine")
        assert main(args()) == 2                          # a folder with no run of the pipeline in it
        assert main(args("--overwrite")) == 0
        fs.pipe_file("elmo-own/out/parquet/keep.parquet", b"also mine")

        def objects():
            fs.invalidate_cache()
            return {p: i["ETag"] for p, i in fs.find("elmo-own/out", detail=True).items()}
        before = objects()
        assert main(args("--layers", "top", "--overwrite")) == 2
        assert objects() == before
        fs.rm_file("elmo-own/out/parquet/keep.parquet")
        assert main(args("--layers", "top", "--overwrite")) == 0
        got = read_output(out, fs)
        assert got[0]["layers"] == ["layer_top"] or got[0]["options"]["layers"] == "top"
        fs.invalidate_cache()
        assert fs.cat_file("elmo-own/out/notes.txt") == b"mine"


def test_a_glob_never_takes_the_output_s_own_files(tmp_path, tiny_model_files):
    """--input 'corpus/**/*.jsonl' --output corpus/emb, run twice (a daily job): the second run finds its own
    dead-letter file under the glob and leaves it out: already complete, not exit 2. A file inside the output
    named literally is still refused; a glob that matches only the output's files is one clear error."""
    from elmo_pipeline.pipeline.run import run
    from elmo_pipeline.pipeline.validate import inputs_outside_output, own_files
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "x.jsonl").write_text('{"id": "1", "text": "the cat sat ."}\n{broken\n', encoding="utf-8")
    options, weights = tiny_model_files
    argv = ["--input", str(corpus / "**" / "*.jsonl"), "--output", str(corpus / "emb"), "--input-format", "jsonl",
            "--id-field", "id", "--options-file", options, "--weight-file", weights, "--progress", "off",
            "--torch-threads", "1"]
    first = run(argv)
    dead = [p for p in corpus.rglob("*.jsonl") if "emb" in p.parts]
    assert dead, "the output holds a JSONL dead-letter file under the glob"
    again = run(argv)                            # the rerun: already complete, not a refusal
    assert again.manifest["run"]["key"] == first.manifest["run"]["key"] and again.manifest["files"] == first.manifest["files"]
    inside = str(dead[0])
    own = lambda: own_files(str(corpus / "emb"))      # noqa: E731
    assert inputs_outside_output([str(corpus / "a" / "x.jsonl"), inside], [str(corpus / "**" / "*.jsonl")],
                                 str(corpus / "emb"), own) == [str(corpus / "a" / "x.jsonl")]
    with pytest.raises(ValueError, match="lies inside --output"):                 # named: refused
        inputs_outside_output([inside], [inside], str(corpus / "emb"), own)
    with pytest.raises(ValueError, match="lies inside --output"):                 # not the pipeline's: refused
        inputs_outside_output([inside], [str(corpus / "emb" / "**")], str(corpus / "emb"))
    with pytest.raises(ValueError, match="only files inside --output"):
        inputs_outside_output([inside], [str(corpus / "emb" / "**")], str(corpus / "emb"), own)


def test_a_sink_never_writes_moves_or_removes_through_a_link_below_its_folder(tmp_path):
    from elmo_pipeline.output.sink import Sink
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "victim.parquet").write_bytes(b"theirs")
    sink, root = Sink.at(str(out))
    sink.put(f"{root}/staged.bin", b"ours")
    os.symlink(elsewhere, out / "parquet")
    for act in (lambda: sink.put(f"{root}/parquet/victim.parquet", b"x"),
                lambda: sink.move(f"{root}/staged.bin", f"{root}/parquet/victim.parquet"),
                lambda: sink.remove(f"{root}/parquet/victim.parquet"),
                lambda: sink.put(f"{root}/../elsewhere/victim.parquet", b"x")):
        with pytest.raises(FileExistsError):
            act()
    with pytest.raises(FileExistsError, match="symbolic link"):
        with sink.open(f"{root}/parquet/new.parquet") as f:
            f.write(b"x")
    assert sorted(os.listdir(elsewhere)) == ["victim.parquet"] and (elsewhere / "victim.parquet").read_bytes() == b"theirs"
    assert (out / "staged.bin").read_bytes() == b"ours"


@pytest.mark.slow
def test_a_link_planted_while_a_run_embeds_takes_no_write_out_of_the_output(tmp_path, tiny_model_files):
    """A directory link planted at <out>/parquet after the run's start-up checks: Finalize refuses to move a shard
    through it (one error line, a file outside the output untouched); with the link removed, the rerun finishes."""
    import subprocess
    import sys
    import time
    inp, out, elsewhere = tmp_path / "in.txt", tmp_path / "out", tmp_path / "elsewhere"
    inp.write_text("".join(f"line {i} of the corpus .\n" for i in range(40)), encoding="utf-8")
    elsewhere.mkdir()
    (elsewhere / "part-00000-of-00001.parquet").write_bytes(b"theirs")
    options, weights = tiny_model_files
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", str(inp), "--output", str(out),
           "--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "off",
           "--tokenizer", "whitespace"]
    env = dict(os.environ, OMP_NUM_THREADS="1", ELMO_PIPELINE_DELAY_AT="embed:3.0")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (out / "_staging").is_dir():
        assert time.time() - t0 < 120 and p.poll() is None, "the run never started staging"
        time.sleep(0.05)
    os.symlink(elsewhere, out / "parquet")
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0 and err.strip().splitlines()[-1].startswith("error: ") and "symbolic link" in err, err
    assert sorted(os.listdir(elsewhere)) == ["part-00000-of-00001.parquet"]
    assert (elsewhere / "part-00000-of-00001.parquet").read_bytes() == b"theirs"
    os.remove(out / "parquet")
    again = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.load(open(out / "manifest.json"))["counts"]["sentences_written"] == 40


@pytest.mark.slow
@pytest.mark.parametrize("name", ["parquet/part-00000-of-00001.parquet", "report.html", "metrics.prom",
                                  "manifest.json", "_SUCCESS", "report.html:fifo", "_SUCCESS:fifo"])
def test_a_file_placed_in_the_output_while_a_run_embeds_is_never_overwritten(name, tmp_path, tiny_model_files):
    """A file (or a FIFO) placed at one of the output's final names after the run's start-up checks (the run held
    at its first commit): Finalize moves nothing over it (one error line, exit 2, the file as it was; no hang on
    the FIFO), and neither `plan` nor another command with --overwrite takes it for the pipeline's (exit 2, still
    there); with it moved away, the same command finishes."""
    import subprocess
    import sys
    import time
    name, fifo = name.split(":")[0], name.endswith(":fifo")
    inp, out, go = tmp_path / "in.txt", tmp_path / "out", tmp_path / "go"
    inp.write_text("".join(f"line {i} of the corpus .\n" for i in range(40)), encoding="utf-8")
    options, weights = tiny_model_files
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", str(inp), "--output", str(out),
           "--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "off",
           "--tokenizer", "whitespace"]
    env = dict(os.environ, OMP_NUM_THREADS="1", ELMO_PIPELINE_HOLD_AT=f"commit:{go}")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not list(out.glob("_staging/*/committed/*.json")):
        assert time.time() - t0 < 120 and p.poll() is None, "the run never committed"
        time.sleep(0.05)
    (out / name).parent.mkdir(exist_ok=True)
    if fifo:
        os.mkfifo(out / name)
    else:
        (out / name).write_bytes(b"theirs")
    go.touch()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and err.strip().splitlines()[-1].startswith("error: "), err
    assert name in err.strip().splitlines()[-1]

    def still_theirs():
        return (out / name).is_fifo() if fifo else (out / name).read_bytes() == b"theirs"
    assert still_theirs()
    plain = dict(os.environ, OMP_NUM_THREADS="1")
    for extra in (["--layers", "top", "--overwrite"], ["--dry-run"]):
        again = subprocess.run(cmd + extra, env=plain, capture_output=True, text=True, timeout=300)
        assert again.returncode == 2, again.stderr
        assert still_theirs()
    os.rename(out / name, tmp_path / "kept")
    again = subprocess.run(cmd, env=plain, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.load(open(out / "manifest.json"))["counts"]["sentences_written"] == 40


def test_temp_files_are_removed_from_the_named_folder_only(tmp_path):
    """fsio.remove_temp_files (Finalize, --overwrite, the elmo command) matches its folder literally: an output folder
    named out[1] removed the temporary manifest.json of out1 beside it (a live run's there: its rename then failed)
    and never its own; a folder, link or FIFO named like a temporary file is no writer's and stays."""
    import fsspec
    from elmo_pipeline.fsio import remove_temp_files
    from elmo_pipeline.fsio.fs import temp_name
    fs = fsspec.filesystem("file")
    mine, other = tmp_path / "out[1]", tmp_path / "out1"
    mine.mkdir()
    other.mkdir()
    theirs, left = temp_name(str(other / "manifest.json")), temp_name(str(mine / "manifest.json"))
    for p in (theirs, left):
        open(p, "wb").close()
    folder, link = temp_name(str(mine / "_SUCCESS")), temp_name(str(mine / "manifest.json"))
    os.mkdir(folder)
    os.symlink(theirs, link)
    remove_temp_files(fs, str(mine), ("manifest.json", "_SUCCESS"))
    assert os.path.exists(theirs) and not os.path.exists(left)
    assert os.path.isdir(folder) and os.path.islink(link)
    remove_temp_files(fs, str(mine), ("manifest.json", "_SUCCESS"), unless_held=True)
    assert os.path.exists(theirs) and os.path.isdir(folder) and os.path.islink(link)
