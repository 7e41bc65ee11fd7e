"""Crash and resume: the pipeline process is SIGKILLed (a real kill of a real `python -m elmo_pipeline.pipeline.run`,
at exact points through the ELMO_PIPELINE_CRASH_AT hook) while embedding, while writing a shard, after
committing one, in the middle of Finalize; rerunning the same command completes, skips the work already
committed and gives what an uninterrupted run gives. A reader polling the output meanwhile never sees a
partial file."""
import glob
import json
import os
import threading

import h5py
import pyarrow.parquet as pq
import pytest

from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import (SMALL, argv, assert_same_output, corpus, read_output, reference,  # noqa: F401 (fixtures)
                                  run_subprocess, write_corpus)
from elmo_pipeline.output import state as resume
from elmo_pipeline.formats.layout import record_ids
from elmo_pipeline.output.names import PLAN
from elmo_pipeline.transforms.write_step import WriteShards
from elmo_pipeline.output.staging import Staging

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes



class Reader(threading.Thread):
    """Polls <out> like an impatient reader: every file under a final name must read whole, and a
    manifest.json, when there is one, must parse and list only whole files."""

    def __init__(self, out):
        super().__init__(daemon=True)
        self.out, self.stop, self.checks, self.errors = out, threading.Event(), 0, []

    def _check(self, path):
        try:
            if path.endswith(".parquet"):
                pq.read_table(path)
            elif path.endswith(".hdf5"):
                with h5py.File(path, "r") as f:
                    for k in f:
                        f[k][...]
            elif path.endswith("manifest.json"):
                with open(path) as f:
                    m = json.load(f)
                for s in m["shards"]:
                    for fmt in ("parquet", "hdf5"):
                        self._check(os.path.join(self.out, s[fmt]))
            self.checks += 1
        except FileNotFoundError:
            pass     # not there (yet): a reader sees nothing, which is fine
        except Exception as e:  # noqa: BLE001 - a partial file
            self.errors.append(f"{path}: {type(e).__name__}: {e}")

    def run(self):
        while not self.stop.is_set():
            for p in glob.glob(os.path.join(self.out, "*", "*.*")) + [os.path.join(self.out, "manifest.json")]:
                self._check(p)
            self.stop.wait(0.005)


def _staging(out):
    (key,) = os.listdir(os.path.join(out, "_staging"))
    return os.path.join(out, "_staging", key)


def _records(st):
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(st, "committed", "*.json")))]


def test_killed_at_each_stage_then_rerun_equals_uninterrupted(corpus, tiny_model_files, reference, tmp_path, capsys):
    out, total = str(tmp_path / "out"), reference[0]["counts"]["sentences"]
    args = argv(tiny_model_files, corpus, out, *SMALL)
    reader = Reader(out)
    reader.start()
    try:
        # 1. killed while embedding the 2nd batch: the shards of the 1st are committed, nothing is final
        p = run_subprocess(args, "embed:2")
        assert p.returncode == -9, p.stderr[-2000:]
        st = _staging(out)
        first = _records(st)
        assert first and not os.path.exists(os.path.join(out, "manifest.json"))
        assert not os.path.exists(os.path.join(out, "_SUCCESS")) and not os.path.exists(os.path.join(out, "parquet"))

        # a different command over the unfinished output is refused, naming the difference
        assert main(argv(tiny_model_files, corpus, out, *SMALL, "--layers", "top")) == 2
        assert "--layers 'all' then, 'top' now" in capsys.readouterr().err

        # 2. the rerun is killed in the middle of writing a shard: a partial Parquet file without a record
        p = run_subprocess(args, "stage_shard:1")
        assert p.returncode == -9, p.stderr[-2000:]
        named = {f for r in _records(st) for f in r["files"].values()}
        partial = [f for f in os.listdir(st) if f.endswith(".parquet") and f not in named]
        # one partial file per shard being written when it died (WriteShards writes up to WRITERS at once);
        # the kept records survived the rerun
        assert 1 <= len(partial) <= WriteShards.WRITERS and len(_records(st)) == len(first)

        # 3. killed right after committing a shard (files and record written, the runner never got it)
        p = run_subprocess(args, "commit:1")
        assert p.returncode == -9, p.stderr[-2000:]
        assert not os.path.exists(os.path.join(st, partial[0]))     # the garbage was cleared
        committed = sum(r["sentences"] for r in _records(st))
        # the other writer thread may commit its shard between this one's record and the kill
        assert 1 <= len(_records(st)) - len(first) <= WriteShards.WRITERS and committed < total

        # 4. killed in Finalize after 3 moves: the plan is written, 3 files have final names, no manifest
        p = run_subprocess(args, "finalize_move:3")
        assert p.returncode == -9, p.stderr[-2000:]
        assert os.path.exists(os.path.join(st, PLAN)) and not os.path.exists(os.path.join(out, "manifest.json"))
        moved = [f for sub in ("parquet", "hdf5", "keys") for f in glob.glob(os.path.join(out, sub, "*"))]
        assert len(moved) == 3
        plan = json.load(open(os.path.join(st, PLAN)))
        assert plan["manifest"]["run"]["resumed_sentences"] == committed   # run 4 skipped what was committed

        # 5. the same command once more: only the Finalize was left, and it is finished
        assert main(args) == 0
        assert "finished the interrupted finalize" in capsys.readouterr().err
    finally:
        reader.stop.set()
        reader.join()
    assert not reader.errors, reader.errors[:3]
    assert reader.checks > 0
    got = read_output(out)
    assert_same_output(got, reference)
    assert 0 < got[0]["run"]["resumed_sentences"] < total and got[0]["run"]["key"] == reference[0]["run"]["key"]
    # the report came with the finished finalize; its sentence lengths cover the resumed shards too
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert got[0]["report"] == "report.html" and f"{total:,} sentences written" in page


@pytest.mark.parametrize("point", ["finalize_manifest:1", "finalize_cleanup:1"])
def test_killed_at_the_end_of_finalize(point, corpus, tiny_model_files, reference, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    p = run_subprocess(args, point)
    assert p.returncode == -9, p.stderr[-2000:]
    assert os.path.exists(os.path.join(out, "manifest.json")) and not os.path.exists(os.path.join(out, "_SUCCESS"))
    assert bool(glob.glob(os.path.join(out, "_staging", "*", "committed"))) == (point == "finalize_manifest:1")
    m = json.load(open(os.path.join(out, "manifest.json")))       # a reader trusting it now reads it all
    for s in m["shards"]:
        assert pq.read_table(os.path.join(out, s["parquet"])).num_rows == s["sentences"]
        with h5py.File(os.path.join(out, s["hdf5"])) as f:
            assert len(f) == s["sentences"] and all(f[k][...].size for k in f)
    assert main(args) == 0
    assert "finished the interrupted finalize" in capsys.readouterr().err
    assert_same_output(read_output(out), reference)
    assert main(args) == 0          # now it is a finished run of this command: nothing to do
    assert "already complete" in capsys.readouterr().err
    assert main(argv(tiny_model_files, corpus, out, *SMALL, "--layers", "top")) == 2    # another command: refused
    assert "pass --overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_an_output_folder_moved_during_an_interrupted_finalize_is_finished_where_it_is(corpus, tiny_model_files,
                                                                                       reference, tmp_path, capsys):
    """Killed in Finalize after 3 moves, the output folder then moved (renamed): the same command on the new path
    finishes the plan there (its staged files are named relative to the staging folder), equal to an uninterrupted
    run."""
    out, moved = str(tmp_path / "out"), str(tmp_path / "moved")
    p = run_subprocess(argv(tiny_model_files, corpus, out, *SMALL), "finalize_move:3")
    assert p.returncode == -9, p.stderr[-2000:]
    os.rename(out, moved)
    assert main(argv(tiny_model_files, corpus, moved, *SMALL)) == 0
    assert "finished the interrupted finalize" in capsys.readouterr().err
    assert_same_output(read_output(moved), reference)


def test_worker_process_killed_then_rerun(corpus, tiny_model_files, reference, tmp_path):
    """2 worker processes over the Fn API; one is SIGKILLed while embedding. The runner reports the lost
    worker and fails; the same command then resumes from what either worker committed."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL, "--direct_num_workers", "2",
                "--direct_running_mode", "multi_processing")
    p = run_subprocess(args, "embed:2", timeout=180)
    assert p.returncode == 70 and "error:" in p.stderr, p.stderr[-2000:]     # a lost worker: not known transient
    assert not os.path.exists(os.path.join(out, "_SUCCESS")) and _records(_staging(out))
    assert main(args) == 0
    got = read_output(out)
    assert_same_output(got, reference)
    assert got[0]["run"]["resumed_sentences"] > 0


def test_a_worker_process_killed_before_its_first_bundle_ends_the_run_never_a_hang(corpus, tiny_model_files,
                                                                                   reference, tmp_path):
    """2 worker processes over the Fn API; one is SIGKILLed as soon as it is started, before any bundle. Beam's
    runner, which notices a lost worker only when it was sending it data (`Channel closed prematurely`), waited for
    its bundle for good while the launcher kept the lease alive (every later run: exit 75). Now the run ends at once
    with exit 70 naming the lost worker, no worker process left behind, and the same command finishes the output."""
    import signal
    import subprocess
    import sys
    import time
    from tests.resume_helpers import REPO
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL, "--direct_num_workers", "2",
                "--direct_running_mode", "multi_processing")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ELMO_PIPELINE_CRASH_AT", None)
    run = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def children(pids):
        found = subprocess.run(["pgrep", "-P", ",".join(map(str, pids))], capture_output=True, text=True)
        return sorted(int(p) for p in found.stdout.split())

    def workers():      # the runner starts each as `/bin/sh -c python -m ...sdk_worker_main`
        shells = children([run.pid])
        return children(shells) if shells else []
    try:
        t0 = time.time()
        while len(workers()) < 2:
            assert run.poll() is None and time.time() - t0 < 120, "the worker processes never started"
            time.sleep(0.005)
        os.kill(workers()[0], signal.SIGKILL)
        try:
            _, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the run waited for its lost worker for good")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    assert run.returncode == 70, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: a worker process of the run exited while it ran"), err[-2000:]
    t0 = time.time()
    while (left := subprocess.run(["pgrep", "-a", "-s", str(run.pid)], capture_output=True, text=True).stdout.strip()):
        assert time.time() - t0 < 10, f"processes of the run left behind: {left}"
        time.sleep(0.1)
    assert not os.path.exists(os.path.join(out, "_lease.json"))
    assert main(args) == 0
    assert_same_output(read_output(out), reference)


# ---- the resume decisions as plain functions, on real files ------------------------------------------

def _stage(st, ids):
    import numpy as np

    from elmo_pipeline.transforms.records import EmbeddedBatch, Item
    from elmo_pipeline.output.staging import ShardSpec
    batch = EmbeddedBatch([Item(i, i.split("#")[0], 0, ("a", "b"), ((0, 1), (2, 3))) for i in ids],
                          np.ones((1, 2 * len(ids), 4), np.float32), np.arange(0, 2 * len(ids) + 1, 2))
    spec = ShardSpec(("parquet", "hdf5"), "sentence", (("layer_0", 2),), (0,), False, "float32", 1 << 20, 1, 4)
    return Staging(st).shard([(batch, b) for b in range(len(ids))], spec)


def test_prepare_output_keeps_disjoint_records_and_clears_garbage(tmp_path, caplog):
    out = str(tmp_path / "out")
    ing = {"version": 1, "inputs": [], "options": {"layers": "all"}, "model": {}}
    key = resume.run_key(ing)
    assert resume.prepare_output(out, key, ing, False).action == "fresh"
    st = os.path.join(out, "_staging", key)
    _stage(st, ["d:1#0", "d:1#1"])
    _stage(st, ["d:1#1", "d:2#0"])       # a retried bundle's shard overlapping the other
    _stage(st, ["d:3#0"])
    open(os.path.join(st, "partial.parquet"), "wb").write(b"PAR1 half")
    os.makedirs(os.path.join(out, "parquet"))      # a finished finalize of this key whose hdf5 file is gone
    open(os.path.join(out, "parquet", "part-00000-of-00009.parquet"), "wb").write(b"stale")
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"schema_version": 1, "run": {"key": key}, "dead_letter_files": [], "shards": [
            {"parquet": "parquet/part-00000-of-00009.parquet", "hdf5": "hdf5/part-00000-of-00009.hdf5"}]}, f)

    state = resume.prepare_output(out, key, ing, False)
    assert state.action == "resume" and len(state.records) == 2
    ids = [i for r in state.records for i in record_ids(r)]
    assert len(ids) == len(set(ids)) == 3 and "d:3#0" in ids
    assert resume.load_done_ids(state.record_paths) == set(ids)
    kept = json.load(open(state.record_paths[0]))
    with open(state.record_paths[0], "w") as f:                       # damaged after it was kept: no ids, a warning
        f.write(json.dumps(kept)[:40])
    assert resume.load_done_ids(state.record_paths) == set(ids) - set(record_ids(kept))
    assert f"{state.record_paths[0]}: not a whole commit record; its sentences are embedded again" in caplog.text
    with open(state.record_paths[0], "w") as f:
        json.dump(kept, f)
    left = sorted(os.listdir(st))
    assert "partial.parquet" not in left and len([f for f in left if f.endswith(".parquet")]) == 2
    assert len(os.listdir(os.path.join(st, "committed"))) == 2 and "run.json" in left
    assert not os.path.exists(os.path.join(out, "parquet"))          # stale final names removed
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert {s.first_id for s in state.shards} == {r["first_id"] for r in state.records}

    # --state stateful keeps nothing (its vectors depend on the batches before)
    assert resume.prepare_output(out, key, ing, False, resumable=False).action == "fresh"
    assert not os.path.exists(os.path.join(st, "committed"))


def test_finalize_twice_is_a_no_op(tmp_path):
    """complete_finalize may run again after it succeeded (a rerun killed after _SUCCESS): same output."""
    from elmo_pipeline.output.finalize import complete_finalize, finalize, plan_from_staging
    from elmo_pipeline.output.staging import Staging
    out = str(tmp_path / "out")
    st = os.path.join(out, "_staging", "k")
    _stage(st, ["d:1#0", "d:1#1"])
    _stage(st, ["d:2#0"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    m1 = finalize(out, st, plan_from_staging(st, ["d"]), {})
    files = sorted(glob.glob(os.path.join(out, "*", "*")))
    assert complete_finalize(out, st) == m1 and os.path.exists(os.path.join(out, "_SUCCESS"))
    assert sorted(glob.glob(os.path.join(out, "*", "*"))) == files
    assert not os.path.exists(os.path.join(out, "_staging"))
    assert [pq.read_table(f).num_rows for f in files if f.endswith(".parquet")] == [2, 1]
    assert m1["counts"]["documents"] == 2 and m1["counts"]["sentences"] == 3


@pytest.mark.parametrize("placed", ["theirs", "fifo", "link"])
def test_a_success_marker_placed_before_the_last_step_is_never_replaced(placed, tmp_path):
    """_SUCCESS placed while Finalize ran (bytes in it, a FIFO, a link to a user's file): complete_finalize writes
    nothing over it (the error a placed file gets), the output is not taken for finished, and no --overwrite takes
    the file for the pipeline's; an empty regular _SUCCESS says what the pipeline's says and is left as it is."""
    from elmo_pipeline.output.finalize import complete_finalize, finalize, plan_from_staging
    from elmo_pipeline.output.ownership import owned_final_names
    from elmo_pipeline.output.staging import Staging
    from elmo_pipeline.output.state import is_complete
    import fsspec
    out = str(tmp_path / "out")
    st = os.path.join(out, "_staging", "k")
    _stage(st, ["d:1#0"])
    Staging(st).counts("d", {"input_records": 1, "blank_records": 0})
    success, users = os.path.join(out, "_SUCCESS"), tmp_path / "users.txt"
    users.write_bytes(b"")
    os.makedirs(out, exist_ok=True)
    if placed == "theirs":
        open(success, "wb").write(b"theirs")
    elif placed == "fifo":
        os.mkfifo(success)
    else:
        os.symlink(users, success)
    with pytest.raises(FileExistsError, match="_SUCCESS: a file this pipeline did not write is there"):
        finalize(out, st, plan_from_staging(st, ["d"]), {"run": {"key": "k"}})
    assert os.path.lexists(success) and (placed != "theirs" or open(success, "rb").read() == b"theirs")
    assert os.path.islink(success) == (placed == "link")
    fs = fsspec.filesystem("file")
    assert json.load(open(os.path.join(out, "manifest.json")))["run"]["key"] == "k" and not is_complete(out, "k")
    assert "_SUCCESS" not in owned_final_names(fs, out) and "manifest.json" in owned_final_names(fs, out)
    os.remove(success)
    open(success, "wb").close()                                # an empty one: the same as the pipeline's
    ino = os.stat(success).st_ino
    assert complete_finalize(out, st) is not None and os.stat(success).st_ino == ino


def test_prepare_output_other_command_refused_or_overwritten(tmp_path):
    out = str(tmp_path / "out")
    old = {"version": 1, "inputs": [["a.txt", 10, "1.0"]], "options": {"layers": "all"}, "model": {}}
    new = {"version": 1, "inputs": [["a.txt", 12, "2.0"]], "options": {"layers": "top"}, "model": {}}
    resume.prepare_output(out, resume.run_key(old), old, False)
    _stage(os.path.join(out, "_staging", resume.run_key(old)), ["d:1#0"])
    with pytest.raises(FileExistsError) as e:
        resume.prepare_output(out, resume.run_key(new), new, False)
    assert "--layers 'all' then, 'top' now" in str(e.value) and "a.txt" in str(e.value)
    assert "--overwrite" in str(e.value)
    state = resume.prepare_output(out, resume.run_key(new), new, True)     # --overwrite: start over
    assert state.action == "fresh" and os.listdir(os.path.join(out, "_staging")) == [resume.run_key(new)]


@pytest.mark.parametrize("damage", ["{", "[1, 2]", '{"options": 5, "inputs": [3, []]}'])
def test_another_commands_damaged_run_json_still_refused_clearly(damage, tmp_path):
    """The unfinished run of another command is refused with the one clear message even when its run.json
    (read only to describe the difference) is damaged."""
    out = str(tmp_path / "out")
    old = {"version": 1, "inputs": [["a.txt", 10, "1.0"]], "options": {"layers": "all"}, "model": {}}
    new = {"version": 1, "inputs": [["a.txt", 12, "2.0"]], "options": {"layers": "top"}, "model": {}}
    resume.prepare_output(out, resume.run_key(old), old, False)
    st = os.path.join(out, "_staging", resume.run_key(old))
    _stage(st, ["d:1#0"])
    with open(os.path.join(st, "run.json"), "w") as f:
        f.write(damage)
    with pytest.raises(FileExistsError, match="holds an unfinished run of a different command .*--overwrite"):
        resume.prepare_output(out, resume.run_key(new), new, False)


def test_run_key_follows_content_not_layout(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("One. Two.\n")
    base = {"layers": "all", "state": "stateless", "shard_sentences": 4, "torch_threads": 1, "sort_buffer": 10}
    model = {"weights_sha256": "ab", "options": {"lstm": {}}}
    key = resume.run_key(resume.run_ingredients(base, resume.input_fingerprints([str(f)]), model))
    same = dict(base, shard_sentences=99, torch_threads=2, sort_buffer=5, device="cpu", overwrite=True)
    assert resume.run_key(resume.run_ingredients(same, resume.input_fingerprints([str(f)]), model)) == key
    for changed in (dict(base, layers="top"), dict(base, state="stateful", sort_buffer=10)):
        assert resume.run_key(resume.run_ingredients(changed, resume.input_fingerprints([str(f)]), model)) != key
    assert resume.run_key(resume.run_ingredients(base, resume.input_fingerprints([str(f)]),
                                                 dict(model, weights_sha256="cd"))) != key
    f.write_text("One. Two. Three.\n")
    assert resume.run_key(resume.run_ingredients(base, resume.input_fingerprints([str(f)]), model)) != key


def test_sigkill_leaves_no_hdf5_temp_file(corpus, tiny_model_files, tmp_path):
    """HDF5 shards are built in memory and written in one call: a process killed right after writing one
    leaves no temporary file anywhere (TMPDIR included), only whole staged files: those commit records name, and
    at most WriteShards.WRITERS - 1 more that another writer thread staged before its record (never listed)."""
    out, tmpdir = str(tmp_path / "out"), tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir))
    import subprocess
    import sys
    from tests.resume_helpers import REPO
    p = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", *argv(tiny_model_files, corpus, out, *SMALL)],
                       cwd=REPO, env=dict(env, ELMO_PIPELINE_CRASH_AT="commit:2", OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == -9, p.stderr[-2000:]
    assert [f for _, _, files in os.walk(tmpdir) for f in files] == []
    st = _staging(out)
    named = {f for r in _records(st) for f in r["files"].values()}
    data = {f for f in os.listdir(st) if os.path.isfile(os.path.join(st, f)) and f != "run.json"}
    from elmo_pipeline.transforms.write_step import WriteShards
    # the kill follows the 2nd counted commit; another writer thread may have put its record just before
    assert 2 <= len(_records(st)) <= 1 + WriteShards.WRITERS and named <= data and not any(".tmp-" in f for f in data)
    unnamed = {f.rsplit(".", 1)[0] for f in data - named}            # a shard's .parquet and .hdf5 share a stem
    assert len(unnamed) <= WriteShards.WRITERS - 1, sorted(data - named)


@pytest.mark.parametrize("damage", ["truncated", "ids", "files"])
def test_a_damaged_commit_record_is_embedded_again(damage, corpus, tiny_model_files, reference, tmp_path, caplog):
    """A commit record that is no whole record (cut short, ids that do not decode, file names of the wrong
    kind) is never trusted: the rerun drops it with its shard and embeds its sentences again, and the output
    equals the uninterrupted run's."""
    out = str(tmp_path / "out")
    args, st = _killed_after_two_commits(tiny_model_files, corpus, out)
    path = sorted(glob.glob(os.path.join(st, "committed", "*.json")))[0]
    rec = json.load(open(path))
    text = {"truncated": json.dumps(rec)[:40], "ids": json.dumps(dict(rec, ids_zlib="bm90IHpsaWI=")),
            "files": json.dumps(dict(rec, files=list(rec["files"].values())))}[damage]
    with open(path, "w") as f:
        f.write(text)
    _resumed_as_uninterrupted(args, out, reference, caplog, "not a whole commit record; its sentences are embedded again")


def test_a_commit_record_of_another_run_is_embedded_again(corpus, tiny_model_files, reference, tmp_path, caplog):
    """Each commit record names the run key of the staging folder it was written into; one naming another (copied
    in from another command's staging folder with its shard: its vectors are that command's) is never published
    by a resume: its sentences are embedded again, and the output equals the uninterrupted run's."""
    out = str(tmp_path / "out")
    args, st = _killed_after_two_commits(tiny_model_files, corpus, out)
    assert {r["run"] for r in _records(st)} == {os.path.basename(st)}
    path = sorted(glob.glob(os.path.join(st, "committed", "*.json")))[0]
    rec = json.load(open(path))
    with open(path, "w") as f:
        json.dump(dict(rec, run="0" * 16), f)
    _resumed_as_uninterrupted(args, out, reference, caplog, "a commit record of another run (run key '0000000000000000')")
    assert "run" not in json.dumps(read_output(out)[0]["shards"])       # the manifest is as before


def _killed_after_two_commits(tiny_model_files, corpus, out):
    """(argv, staging folder) of a run killed (SIGKILL) just after its 2nd commit."""
    args = argv(tiny_model_files, corpus, out, *SMALL)
    p = run_subprocess(args, "commit:2")
    assert p.returncode == -9, p.stderr[-2000:]
    return args, _staging(out)


def _resumed_as_uninterrupted(args, out, reference, caplog, says):
    """The same command resumes (logging `says`), keeps some committed sentences, and gives the uninterrupted output."""
    assert main(args) == 0
    assert says in caplog.text
    got = read_output(out)
    assert_same_output(got, reference)
    assert got[0]["run"]["resumed_sentences"] < reference[0]["counts"]["sentences"]


@pytest.mark.parametrize("damage", ["byte", "other shard", "cut", "byte, digests gone", "byte, one digest gone"])
def test_a_committed_shard_changed_since_is_embedded_again(damage, corpus, tiny_model_files, reference, tmp_path,
                                                           caplog):
    """A committed shard whose file is not the one its commit record's digests describe (a byte changed, another
    shard's file copied over it, cut short), or whose record of this version lost its digests (all, or one file's:
    nothing to check it against), is never published by a resume: the rerun drops its record and embeds its
    sentences again, and the output equals the uninterrupted run's."""
    out = str(tmp_path / "out")
    args, st = _killed_after_two_commits(tiny_model_files, corpus, out)
    first, second = _records(st)[:2]
    path = os.path.join(st, first["files"]["parquet"])
    data = open(path, "rb").read()
    data = {"byte": data[:100] + bytes([data[100] ^ 1]) + data[101:], "cut": data[:-1],
            "other shard": open(os.path.join(st, second["files"]["parquet"]), "rb").read()}[damage.split(",")[0]]
    with open(path, "wb") as f:
        f.write(data)
    if "gone" in damage:
        rec_path = next(p for p in glob.glob(os.path.join(st, "committed", "*.json"))
                        if json.load(open(p))["files"] == first["files"])
        rec = json.load(open(rec_path))
        rec["digests"] = {k: v for k, v in rec["digests"].items() if k != "parquet"} if "one" in damage else None
        rec = {k: v for k, v in rec.items() if v is not None}
        assert "kernel_paths" in rec and "run" in rec
        with open(rec_path, "w") as f:
            json.dump(rec, f)
    _resumed_as_uninterrupted(args, out, reference, caplog, "its shard's sentences are embedded again")


def test_plan_from_staging_refuses_an_incomplete_staging(tmp_path):
    """Sentences only in a shard whose file is gone, or an input file without counts: Incomplete (run()
    then embeds the missing sentences in another round); overlapping duplicates are not incomplete."""
    from elmo_pipeline.output.finalize import Incomplete, plan_from_staging
    from elmo_pipeline.output.staging import Staging
    st = str(tmp_path / "out" / "_staging" / "k")
    _stage(st, ["d:1#0", "d:1#1"])
    _stage(st, ["d:1#0", "d:1#1"])            # a recomputed bundle's copy
    lost = _stage(st, ["d:2#0"])
    with pytest.raises(Incomplete, match="input file"):
        plan_from_staging(st, ["d"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    assert sum(s.sentences for s in plan_from_staging(st, ["d"]).shards) == 3
    os.remove(lost.files["hdf5"])
    with pytest.raises(Incomplete, match="1 sentence"):
        plan_from_staging(st, ["d"])


def test_plan_from_staging_refuses_a_staged_shard_of_another_size(tmp_path, caplog):
    """A staged shard file whose size is not the one its commit record's digests give (replaced since its worker
    wrote it) is never published: Incomplete, naming the file (the next round resumes, checks it whole, drops it
    and embeds its sentences again)."""
    from elmo_pipeline.output.finalize import Incomplete, plan_from_staging
    st = str(tmp_path / "out" / "_staging" / "k")
    _stage(st, ["d:1#0", "d:1#1"])
    shard = _stage(st, ["d:2#0"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    assert sum(s.sentences for s in plan_from_staging(st, ["d"]).shards) == 3
    with open(shard.files["parquet"], "ab") as f:
        f.write(b"appended by someone else")
    with pytest.raises(Incomplete, match="1 sentence"):
        plan_from_staging(st, ["d"])
    assert "changed since it was staged" in caplog.text and os.path.basename(shard.files["parquet"]) in caplog.text


def test_a_staged_shard_replaced_before_finalize_is_embedded_again(corpus, tiny_model_files, reference, tmp_path,
                                                                   caplog, monkeypatch):
    """A staged shard replaced between its commit and Finalize (another shard's file copied over it) is not
    published under the output's names: the run embeds its sentences again and equals the uninterrupted run."""
    from elmo_pipeline.output import lifecycle
    out = str(tmp_path / "out")
    real, swapped = lifecycle.plan_from_staging, []

    def swap_then_plan(staging, *a, **k):
        if not swapped:
            first, second = _records(staging)[:2]
            with open(os.path.join(staging, second["files"]["parquet"]), "rb") as f:
                other = f.read()
            with open(os.path.join(staging, first["files"]["parquet"]), "wb") as f:
                f.write(other)
            swapped.append(first["files"]["parquet"])
        return real(staging, *a, **k)
    monkeypatch.setattr(lifecycle, "plan_from_staging", swap_then_plan)
    assert main(argv(tiny_model_files, corpus, out, *SMALL)) == 0
    assert swapped and "changed since it was staged" in caplog.text
    assert_same_output(read_output(out), reference)


def test_plan_from_staging_refuses_damaged_staged_files(tmp_path):
    """At Finalize a damaged commit record, counts file or dead-letter line is Incomplete (the next round drops
    it and writes it anew), never a crash nor an output without its sentences; a damaged statistics file only
    leaves the run report."""
    from elmo_pipeline.output.finalize import Incomplete, plan_from_staging
    from elmo_pipeline.output.staging import Staging
    st = str(tmp_path / "out" / "_staging" / "k")
    _stage(st, ["d:1#0", "d:1#1"])
    _stage(st, ["d:2#0"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    assert sum(s.sentences for s in plan_from_staging(st, ["d"]).shards) == 3
    (record,) = [p for p in glob.glob(os.path.join(st, "committed", "*.json")) if json.load(open(p))["sentences"] == 1]
    whole = open(record).read()
    for text in ("[1, 2]", whole[:30], json.dumps(dict(json.loads(whole), sentences="1"))):
        open(record, "w").write(text)
        with pytest.raises(Incomplete, match="not a whole commit record"):
            plan_from_staging(st, ["d"])
    open(record, "w").write(whole)
    (counts,) = glob.glob(os.path.join(st, "counts", "*.json"))
    for text in ("{", json.dumps({"url": "d", "part": [3, 1], "input_records": 2, "blank_records": 0})):
        open(counts, "w").write(text)
        with pytest.raises(Incomplete, match="a damaged staged file"):
            plan_from_staging(st, ["d"])
    Staging(st).counts("d", {"input_records": 2, "blank_records": 0})
    os.makedirs(os.path.join(st, "dead"), exist_ok=True)
    open(os.path.join(st, "dead", "x.jsonl"), "w").write('{"id": "d:3#0", "reason": 5}\n')
    with pytest.raises(Incomplete, match="x.jsonl: a damaged staged file"):
        plan_from_staging(st, ["d"])
    os.remove(os.path.join(st, "dead", "x.jsonl"))
    os.makedirs(os.path.join(st, "stats"), exist_ok=True)
    for text in ("[", '{"seconds": {"embed": "1.5"}}', '{"padding": {"8": [1, 2]}}', '{"span": [1]}'):
        open(os.path.join(st, "stats", "x.json"), "w").write(text)
        assert plan_from_staging(st, ["d"]).stats == []
    whole = {"seconds": {"embed": 1.5}, "tokens_at": {"1700000000": 12}, "padding": {"8": [1, 6, 8]},
             "hosts": {"h:1": 1}, "span": [1.0, 2.0]}
    open(os.path.join(st, "stats", "x.json"), "w").write(json.dumps(whole))
    assert plan_from_staging(st, ["d"]).stats == [whole]


@pytest.mark.parametrize("damage", ["not json", "escaping move", "no manifest", "source outside", "source above",
                                    "relative source above", "a source not a name", "records gone"])
def test_a_damaged_finalize_plan_is_not_followed(damage, tmp_path):
    """A finalize.json that is no whole plan (not JSON, a move to a name outside the output's final names, no
    manifest, a staged file outside its staging folder, a manifest without the file records its version writes) is
    never carried out: the run resumes from its commit records (the plan removed with the other
    leftovers), and no file is moved anywhere."""
    out = str(tmp_path / "out")
    ing = {"version": 1, "inputs": [], "options": {"layers": "all"}, "model": {}}
    key = resume.run_key(ing)
    resume.prepare_output(out, key, ing, False)
    st = os.path.join(out, "_staging", key)
    shard = _stage(st, ["d:1#0", "d:1#1"])
    src = shard.files["parquet"]
    manifest = {"schema_version": 1, "shards": [], "run": {"key": key}}
    plan = {"not json": "{\"moves\": [", "escaping move": json.dumps({"moves": [[src, "../escaped.parquet"]],
                                                                       "manifest": manifest}),
            "no manifest": json.dumps({"moves": [[src, "parquet/part-00000-of-00001.parquet"]]}),
            "source outside": json.dumps({"moves": [[str(tmp_path / "x.parquet"), "parquet/part-00000-of-00001.parquet"]],
                                          "manifest": manifest}),
            "source above": json.dumps({"moves": [["../../x.parquet", "parquet/part-00000-of-00001.parquet"]],
                                        "manifest": manifest}),
            "relative source above": json.dumps({"moves": [["../../x.parquet", "parquet/part-00000-of-00001.parquet"]],
                                                 "sources_relative": True, "manifest": manifest}),
            "a source not a name": json.dumps({"moves": [[str(tmp_path / "x.parquet"), "parquet/part-00000-of-00001.parquet"],
                                                         [0, "parquet/part-00001-of-00002.parquet"]],
                                               "manifest": manifest}),
            "records gone": json.dumps({"moves": [[src, "parquet/part-00000-of-00001.parquet"]],
                                        "manifest": {**manifest, "kernel_path": None}})}[damage]
    with open(os.path.join(st, PLAN), "w") as f:
        f.write(plan)
    state = resume.prepare_output(out, key, ing, False)
    assert state.action == "resume" and len(state.records) == 1
    assert not os.path.exists(os.path.join(st, PLAN)) and os.path.exists(src)
    assert not os.path.exists(os.path.join(str(tmp_path), "escaped.parquet"))
    assert not os.path.exists(os.path.join(out, "parquet"))


def test_a_run_resumed_on_another_kernel_path_embeds_everything_again(corpus, tiny_model_files, reference, tmp_path,
                                                                       caplog, monkeypatch):
    """The interrupted run computed on one LSTM loop; the rerun plans another (ELMO_LSTM_GEMM): the committed shards
    are embedded again, never mixed with the rerun's under its manifest's one kernel path."""
    out = str(tmp_path / "out")
    args, st = _killed_after_two_commits(tiny_model_files, corpus, out)
    before = json.load(open(os.path.join(st, "run.json")))["kernel_path"]["lstm_loop"]
    monkeypatch.setenv("ELMO_LSTM_GEMM", "onednn" if before[0] == "bmm" else "bmm")
    assert main(args) == 0
    assert "the interrupted run computed on another kernel path (LSTM loop" in caplog.text
    got = read_output(out)
    assert got[0]["run"]["resumed_sentences"] == 0 and got[0]["kernel_path"]["lstm_loop"] != before


def test_an_interrupted_finalize_with_a_changed_file_is_rolled_back(corpus, tiny_model_files, reference, tmp_path,
                                                                     caplog, capsys):
    """Killed after Finalize moved a shard; that shard then changed (a byte): the rerun does not finish the plan with
    it (each planned file is checked against the plan's records): the changed file is not the one the plan
    recorded, so anyone's: exit 2 naming it, left as it is; moved away, the rerun rolls the plan back and embeds that
    shard again."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    p = run_subprocess(args, "finalize_move:3")
    assert p.returncode == -9, p.stderr[-2000:]
    moved = sorted(glob.glob(os.path.join(out, "hdf5", "part-*.hdf5")))[0]
    data = bytearray(open(moved, "rb").read())
    data[-100] ^= 1
    open(moved, "wb").write(bytes(data))
    assert main(args) == 2
    assert os.path.relpath(moved, out) in capsys.readouterr().err.strip().splitlines()[-1]
    assert open(moved, "rb").read() == bytes(data)
    os.rename(moved, str(tmp_path / "changed.hdf5"))
    assert main(args) == 0
    assert "rolling it back" in caplog.text
    assert_same_output(read_output(out), reference)


def test_a_fifo_at_a_staged_commit_record_never_blocks(corpus, tiny_model_files, reference, tmp_path):
    """A FIFO where a commit record was: the rerun (a process of its own, with a time limit) takes it for a damaged
    record, embeds its sentences again and finishes."""
    out = str(tmp_path / "out")
    args, st = _killed_after_two_commits(tiny_model_files, corpus, out)
    record = sorted(glob.glob(os.path.join(st, "committed", "*.json")))[0]
    os.remove(record)
    os.mkfifo(record)
    p = run_subprocess(args, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert_same_output(read_output(out), reference)
