"""The seams between the pipeline and what it writes to: a symbolic link where the output goes is refused and
never written or deleted through; Arrow shards reach an object store; a run whose lease was taken over stages
nothing more (the workers' Fence); `plan` and `run --dry-run` write nothing. Real pipeline runs (in-process
and as `python -m elmo_pipeline.pipeline.run` processes), real files, moto's S3 server on loopback."""
import json
import os
import re
import time

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmo_pipeline.output import lease as lease_module
from elmo_pipeline.output.lease import Fence, LeaseLost
from elmo_pipeline.output.ownership import links_inside
from elmo_pipeline.pipeline.cli import main as cli_main
from elmo_pipeline.pipeline.run import main
from tests.pipeline_helpers import moto_s3
from tests.resume_helpers import SMALL, argv, corpus, run_subprocess, write_corpus  # noqa: F401 (fixtures)
from tests.test_concurrent_runs import _snapshot, _start, _wait_for


def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def _fill(folder, names):
    for rel in names:
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"not the pipeline's: {rel}\n")


def _run_key(args, capsys):
    """The run key `elmo-pipeline plan` prints for the command `args`."""
    capsys.readouterr()
    assert cli_main(["plan", *args]) == 0
    return re.search(r"^run key (\w+)$", capsys.readouterr().out, re.M).group(1)


# ---- row 1: symbolic links where the pipeline writes --------------------------------------------------

def test_links_inside_names_every_link_under_the_pipelines_names_without_following_them(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    _fill(str(elsewhere), ["a.txt", "deep/b.txt"])
    (elsewhere / "deep" / "loop").symlink_to(elsewhere)         # followed, this walk would never end
    (out / "_staging" / "k" / "committed").mkdir(parents=True)
    (out / "_staging" / "k" / "committed" / "x.json").symlink_to(elsewhere / "a.txt")
    (out / "_staging" / "k" / "stats").symlink_to(elsewhere)
    (out / "parquet").symlink_to(elsewhere)
    (out / "_SUCCESS").symlink_to(elsewhere / "a.txt")
    (out / "notes").symlink_to(elsewhere)                       # not a name the pipeline writes: left alone
    from elmo_pipeline.fsio import url_fs
    fs, root = url_fs(str(out))
    assert links_inside(fs, root) == ["_SUCCESS", "_staging/k/committed/x.json", "_staging/k/stats", "parquet"]
    os.remove(out / "_SUCCESS")
    os.remove(out / "parquet")
    os.remove(out / "_staging" / "k" / "stats")
    os.remove(out / "_staging" / "k" / "committed" / "x.json")
    assert links_inside(fs, root) == []
    (out / "_staging" / "k").rename(tmp_path / "k")
    (out / "_staging" / "k").symlink_to(tmp_path / "k")
    assert links_inside(fs, root) == ["_staging/k"]


@pytest.mark.parametrize("where", ["_staging/KEY", "_staging", "parquet", "_staging/KEY/committed"])
def test_a_link_planted_where_the_output_goes_is_refused_and_nothing_outside_changes(where, tiny_model_files,
                                                                                     tmp_path, capsys):
    """Row 1: a symbolic link at the run's staging folder, at _staging/, at a shard folder or inside the staging
    folder, pointing outside the output: the run exits 2 with one line naming the link, and neither the files
    it points to nor the link change (the pipeline never writes or deletes through a link)."""
    corpus_file = write_corpus(str(tmp_path / "docs.txt"), n_docs=3)
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus_file, out)
    victim = str(tmp_path / "precious")
    _fill(victim, ["a.txt", "b/c.txt"])
    link = where.replace("KEY", _run_key(args, capsys))
    os.makedirs(os.path.dirname(os.path.join(out, link)), exist_ok=True)
    os.symlink(victim, os.path.join(out, link))
    before = _snapshot(victim)
    for extra in ((), ("--overwrite",)):
        capsys.readouterr()
        assert main([*args, *extra]) == 2
        (line,) = _error_lines(capsys.readouterr().err)
        assert f"symbolic link(s) where this pipeline writes: {link}." in line, line
        assert _snapshot(victim) == before
        assert os.readlink(os.path.join(out, link)) == victim


# ---- row 8: Arrow shards on an object store ------------------------------------------------------------

def _arrow_rows(fs, root, manifest):
    """Every row of the manifest's Arrow shards (read with pyarrow's IPC reader), sorted by sentence id."""
    tables = []
    for s in manifest["shards"]:
        with fs.open(f"{root}/{s['arrow']}", "rb") as f:
            tables.append(pa.ipc.open_file(pa.BufferReader(f.read())).read_all())
    return sorted(pa.concat_tables(tables).to_pylist(), key=lambda r: (r["id"], r.get("token_index", 0)))


@pytest.mark.slow   # a moto S3 server
def test_arrow_shards_written_to_s3_are_readable_and_equal_to_local(tiny_model_files, tmp_path):
    """Row 8: --format parquet,arrow into s3:// finishes (exit 0) and its .arrow objects read back with pyarrow,
    row for row equal to the same run into a local folder."""
    import fsspec
    corpus_file = write_corpus(str(tmp_path / "docs.txt"), n_docs=4)
    local = str(tmp_path / "out")
    assert main(argv(tiny_model_files, corpus_file, local, "--format", "parquet,arrow")) == 0
    lfs = fsspec.filesystem("file")
    want_manifest = json.loads(lfs.cat_file(f"{local}/manifest.json"))
    want = _arrow_rows(lfs, local, want_manifest)
    assert want and all(s["arrow"].endswith(".arrow") for s in want_manifest["shards"])
    with moto_s3("elmo-arrow") as (endpoint, fs):
        fs.put_file(corpus_file, "elmo-arrow/in/docs.txt")
        s3 = ("--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing")
        assert main(argv(tiny_model_files, "s3://elmo-arrow/in/docs.txt", "s3://elmo-arrow/out",
                         "--format", "parquet,arrow", *s3)) == 0
        fs.invalidate_cache()
        assert fs.exists("elmo-arrow/out/_SUCCESS")
        manifest = json.loads(fs.cat_file("elmo-arrow/out/manifest.json"))
        assert len(manifest["shards"]) == len(want_manifest["shards"])
        got = _arrow_rows(fs, "elmo-arrow/out", manifest)
    assert [{k: v for k, v in r.items() if k != "doc_id"} for r in got] == \
        [{k: v for k, v in r.items() if k != "doc_id"} for r in want]


# ---- row 13: a run whose lease was taken over stages nothing more ----------------------------------------

SLOWER = "embed:2.0"    # each batch 2 s slower: longer than the Fence trusts a heartbeat (stale 2 s - beat 0.5 s)


def _taker(now):
    """A lease object of another run (a host whose clock is ahead: it judged this run's lease stale)."""
    return json.dumps({"token": "another-run", "owner": "", "host": "another-host", "machine": "", "pid": 1,
                       "pidns": "", "start": now, "heartbeat": now}).encode()


def _taken_over_run(args, staged, take_over, lease_token):
    """Start a slowed run, wait for its first commit record, take its lease over, and return (process, staged
    files at the takeover, its stderr)."""
    first = _start(args, delay=SLOWER)
    try:
        _wait_for(lambda: any("/committed/" in p for p in staged()), timeout=120, what="the first commit record")
        at_takeover, t0 = staged(), time.time()
        while time.time() - t0 < 0.4:         # the rest of that batch's shards: staged before the takeover
            time.sleep(0.1)
            now = staged()
            if now != at_takeover:
                at_takeover, t0 = now, time.time()
        take_over()
        assert first.poll() is None, "the run ended before its lease was taken over: make it slower"
        assert sum("/committed/" in p for p in at_takeover) < 12, "all 12 shards staged before the takeover"
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert lease_token() == "another-run"     # the lease is the other run's: left alone
    return first, at_takeover, err


@pytest.mark.slow   # real processes
def test_a_run_whose_lease_was_taken_over_stages_nothing_more(corpus, tiny_model_files, tmp_path):
    """Row 13: while a run embeds, another run takes its lease over; the first exits 75 with one line, and not
    one file (shard, commit record, stats, counts) is staged, changed or removed after the takeover."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL, "--lease-stale-seconds", "2")
    lease = os.path.join(out, "_lease.json")

    def staged():
        return {f"_staging/{p}": v for p, v in _snapshot(os.path.join(out, "_staging")).items()}

    def take_over():
        with open(lease + ".tmp", "wb") as f:
            f.write(_taker(time.time()))
        os.replace(lease + ".tmp", lease)
    first, at_takeover, err = _taken_over_run(args, staged, take_over, lambda: json.load(open(lease))["token"])
    assert first.returncode == 75, err[-2000:]
    (line,) = _error_lines(err)
    assert "lost the lease" in line, line
    assert staged() == at_takeover
    assert not os.path.exists(os.path.join(out, "manifest.json"))


@pytest.mark.slow   # real processes, a moto S3 server
def test_a_run_on_s3_whose_lease_was_taken_over_stages_nothing_more(corpus, tiny_model_files):
    """Row 13 on s3:// (moto): the same, with the objects' ETags compared."""
    with moto_s3("elmo-fence") as (endpoint, fs):
        fs.put_file(corpus, "elmo-fence/in/docs.txt")
        s3 = ("--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing")
        args = argv(tiny_model_files, "s3://elmo-fence/in/docs.txt", "s3://elmo-fence/out", *SMALL, *s3,
                    "--lease-stale-seconds", "2")

        def staged():
            fs.invalidate_cache()
            found = fs.find("elmo-fence/out/_staging", detail=True)
            return {p: i.get("ETag") for p, i in found.items()}

        def token():
            fs.invalidate_cache()
            return json.loads(fs.cat_file("elmo-fence/out/_lease.json"))["token"]
        first, at_takeover, err = _taken_over_run(
            args, staged, lambda: fs.pipe_file("elmo-fence/out/_lease.json", _taker(time.time())), token)
        assert first.returncode == 75, err[-2000:]
        (line,) = _error_lines(err)
        assert "lost the lease" in line, line
        assert staged() == at_takeover
        assert not fs.exists("elmo-fence/out/manifest.json")


STALE, BEAT = 2.0, 0.5
steps = st.lists(st.one_of(st.tuples(st.just("wait"), st.floats(0.0, 3.0)), st.just(("beat",)),
                           st.just(("check",)), st.just(("take over",)), st.just(("take over when stale",))),
                 max_size=40)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_fence_never_passes_after_a_takeover_it_cannot_trust_past(tmp_path_factory, steps):
    """Any interleaving of the holder's heartbeats, another run's takeovers (one judged stale by a clock ahead,
    at any moment; or one the protocol allows: the heartbeat older than the stale age) and worker checks, on a
    real lease file, with a controlled clock:
    - a check fails (LeaseLost) once the lease carries another token and the heartbeat the fence last read
      (its cache) is stale - beat old or more; after a takeover the protocol allows it never passes;
    - it passes while the lease is this run's;
    - it reads the lease object at most once per check, and not at all while it trusts its cache."""
    folder = tmp_path_factory.mktemp("fence")
    url = str(folder / "_lease.json")
    clock = [1000.0]
    reads = []
    real_read = lease_module.read_lease

    def counted(*a):
        reads.append(1)
        return real_read(*a)

    def store(token, beat):
        with open(url, "w") as f:
            json.dump({"token": token, "host": "h", "pid": 1, "pidns": "", "start": 0, "heartbeat": beat}, f)

    mine = {"token": "mine", "heartbeat": clock[0]}
    store("mine", clock[0])
    fence = Fence(url, "mine", STALE, BEAT)
    legit_takeover = False
    old = lease_module.read_lease, lease_module.time
    lease_module.read_lease = counted
    lease_module.time = type("Clock", (), {"time": staticmethod(lambda: clock[0])})
    try:
        for step in steps:
            now = clock[0]
            if step[0] == "wait":
                clock[0] += step[1]
            elif step[0] == "beat" and mine["token"] == "mine":        # the holder beats while it holds
                mine["heartbeat"] = now
                store("mine", now)
            elif step[0] == "take over":
                mine["token"] = "other"
                store("other", now)
            elif step[0] == "take over when stale" and now - mine["heartbeat"] > STALE:
                legit_takeover = mine["token"] == "mine" or legit_takeover
                mine["token"] = "other"
                store("other", now)
            elif step[0] == "check":
                trusted = fence.seen is not None and now - fence.seen < STALE - BEAT
                reads.clear()
                try:
                    fence()
                    passed = True
                except LeaseLost:
                    passed = False
                assert len(reads) == (0 if trusted else 1)
                if mine["token"] == "mine":
                    assert passed
                elif not trusted or legit_takeover:
                    assert not passed
    finally:
        lease_module.read_lease, lease_module.time = old


# ---- plan and --dry-run write nothing ------------------------------------------------------------------

def _listing(folder):
    """Every file and folder under `folder` (sizes and mtimes), or None when it does not exist."""
    if not os.path.exists(folder):
        return None
    out = {}
    for d, dirs, files in os.walk(folder):
        for name in dirs + files:
            st_ = os.lstat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), folder)] = (st_.st_size, st_.st_mtime_ns, st_.st_mode)
    return out


@pytest.mark.slow   # a killed process
@pytest.mark.parametrize("state", ["finished", "interrupted"])
def test_plan_and_dry_run_leave_an_existing_output_as_it_was(state, tiny_model_files, tmp_path, capsys):
    """`elmo-pipeline plan` and `run --dry-run` (the same command, with --overwrite, another command: refused as
    the run refuses it) on a finished output and on one a killed run left (staged shards, its lease): not one file
    or folder added, changed or removed, mtimes included. (A missing output staying missing: tests/test_iceberg_commit.py.)"""
    corpus_file = write_corpus(str(tmp_path / "docs.txt"), n_docs=8)
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus_file, out, *SMALL)
    if state == "finished":
        assert main(args) == 0
    else:
        p = run_subprocess(args, crash_at="commit:2")
        assert p.returncode == -9, p.stderr[-2000:]
        assert os.path.exists(os.path.join(out, "_lease.json")) and os.listdir(os.path.join(out, "_staging"))
    before = _listing(out)
    time.sleep(0.05)        # a rewrite with the same bytes would show in the mtimes
    for extra in ((), ("--overwrite",), ("--layers", "top")):      # the same command, a redo, another command
        refused = extra == ("--layers", "top")      # as the run would refuse it: exit 2, the same line
        assert cli_main(["plan", *args, *extra]) == (2 if refused else 0)
        assert main([*args, *extra, "--dry-run"]) == (2 if refused else 0)
        captured = capsys.readouterr()
        if refused:
            assert captured.err.strip().splitlines()[-1].startswith("error: ") and "different command" in captured.err
        else:
            assert f"--output {out} " in captured.out
        assert _listing(out) == before


def test_a_folder_at_a_files_final_name_is_refused_and_left_as_it_was(tmp_path):
    """output/sink.py Sink.move: a folder made at a final name while a run works is not moved into (a local rename
    onto a folder puts the file inside it); the staged file stays where it was."""
    from elmo_pipeline.output.sink import Sink
    sink, root = Sink.at(str(tmp_path / "out"))
    sink.put(f"{root}/_staging/a.parquet", b"staged")
    os.makedirs(f"{root}/part-00000.parquet")
    with open(f"{root}/part-00000.parquet/mine.txt", "w") as f:
        f.write("the user's")
    with pytest.raises(IsADirectoryError, match="a folder where this pipeline writes a file"):
        sink.move(f"{root}/_staging/a.parquet", f"{root}/part-00000.parquet")
    assert os.listdir(f"{root}/part-00000.parquet") == ["mine.txt"]
    assert open(f"{root}/_staging/a.parquet", "rb").read() == b"staged"
