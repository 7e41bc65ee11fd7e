"""Schedulers: a second trigger while the first run lives, a lost machine, a damaged finalize, retries of a
finished task. Real `python -m elmo_pipeline.pipeline.run` processes (killed with real SIGKILLs), on local folders and on
moto's S3 server on loopback."""
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from elmo_pipeline.pipeline.run import main
from tests.pipeline_helpers import moto_s3
from tests.resume_helpers import (REPO, SMALL, argv, assert_same_output, corpus, read_output,  # noqa: F401 (fixtures)
                                  reference, run_subprocess, write_corpus)

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes

def _start(args, hold=None, crash_at=None, delay=None):
    """The pipeline in a process of its own; hold: a path, the run waits at its first batch until it exists
    (ELMO_PIPELINE_HOLD_AT, tests/faults); delay: ELMO_PIPELINE_DELAY_AT."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ELMO_PIPELINE_CRASH_AT", None)
    if delay:
        env["ELMO_PIPELINE_DELAY_AT"] = delay
    if hold:
        env["ELMO_PIPELINE_HOLD_AT"] = f"embed:{hold}"
    if crash_at:
        env["ELMO_PIPELINE_CRASH_AT"] = crash_at
    return subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout=120, what=""):
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def _lease(out):
    with open(os.path.join(out, "_lease.json")) as f:
        return json.load(f)


def _snapshot(root):
    """{relative path: (sha256, mtime_ns)} of every file under root."""
    snap = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                snap[os.path.relpath(p, root)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return snap


def test_second_run_while_the_first_lives_exits_75_naming_it(corpus, tiny_model_files, reference, tmp_path):
    """(1) Two identical commands seconds apart on one output: the second exits 75 (retry later) at once naming the
    holder and touches nothing; the first completes."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    go = tmp_path / "go"
    first = _start(args, hold=go)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(out, "_lease.json")), what="the first run's lease")
        holder = _lease(out)
        assert holder["pid"] == first.pid
        t0 = time.time()
        second = run_subprocess(args)
        took = time.time() - t0
        assert first.poll() is None, "the first run ended before the second had"
        assert second.returncode == 75, second.stderr[-2000:]
        assert f"is held by a live run: pid {first.pid} on host" in second.stderr, second.stderr[-2000:]
        assert _lease(out)["token"] == holder["token"]         # the second run left the lease alone
        go.touch()
        _, err = first.communicate(timeout=240)
    finally:
        first.kill()
    assert first.returncode == 0, err[-2000:]
    assert_same_output(read_output(out), reference)
    assert not os.path.exists(os.path.join(out, "_lease.json"))
    print(f"second run refused in {took:.1f} s (process start, model check and run key included)")


def test_lease_of_a_killed_run_on_a_lost_machine_is_taken_over_when_stale(corpus, tiny_model_files, reference,
                                                                          tmp_path):
    """(2) The holder is SIGKILLed; as if its machine were lost (another host, so no process to check), its
    lease is refused while its heartbeat is fresh and taken over once older than --lease-stale-seconds; the
    run then completes equal to an uninterrupted run."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL, "--lease-stale-seconds", "10")
    p = run_subprocess(args, "embed:3")
    assert p.returncode == -9, p.stderr[-2000:]
    lease = _lease(out)
    lease.update(host="a-lost-machine", heartbeat=time.time())     # its last heartbeat: just now
    with open(os.path.join(out, "_lease.json"), "w") as f:
        json.dump(lease, f)
    early = run_subprocess(args)
    assert early.returncode == 75 and "on host a-lost-machine" in early.stderr, early.stderr[-2000:]
    assert "older than 10 s (--lease-stale-seconds)" in early.stderr
    lease.update(heartbeat=time.time() - 10.5)     # no heartbeat since: 10.5 s ago, past the stale age
    with open(os.path.join(out, "_lease.json"), "w") as f:
        json.dump(lease, f)
    late = run_subprocess(args)
    assert late.returncode == 0, late.stderr[-2000:]
    assert "took over a stale lease: pid" in late.stderr and "a-lost-machine" in late.stderr
    got = read_output(out)
    assert_same_output(got, reference)
    assert got[0]["run"]["resumed_sentences"] > 0


def test_a_finalize_plan_with_a_lost_file_is_healed_by_a_rerun(corpus, tiny_model_files, reference, tmp_path):
    """(3) Finalize killed after 3 moves, then a staged file of its plan is deleted (what a second run's
    finalize did in the issue): the rerun rolls the plan back, re-embeds that shard and completes."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    p = run_subprocess(args, "finalize_move:3")
    assert p.returncode == -9, p.stderr[-2000:]
    (key,) = os.listdir(os.path.join(out, "_staging"))
    st = os.path.join(out, "_staging", key)
    plan = json.load(open(os.path.join(st, "finalize.json")))
    lost_name = next(src for src, _ in plan["moves"][3:] if src.endswith(".parquet"))   # named inside st
    lost = os.path.join(st, lost_name)
    os.remove(lost)
    moved = [os.path.join(out, rel) for _, rel in plan["moves"][:3]]
    assert all(os.path.exists(m) for m in moved)
    rerun = run_subprocess(args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "rolling it back" in rerun.stderr
    got = read_output(out)
    assert_same_output(got, reference)
    lost_sentences = next(s["sentences"] for s in plan["manifest"]["shards"] if s["parquet"] in
                          {rel for src, rel in plan["moves"] if src == lost_name})
    assert got[0]["run"]["resumed_sentences"] == reference[0]["counts"]["sentences_written"] - lost_sentences


def test_the_same_command_on_a_finished_output_changes_nothing(corpus, tiny_model_files, tmp_path):
    """(4) A retried task: exit 0 'already complete', not one byte (or mtime) changed; another
    command is still refused."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    t0 = time.time()
    assert run_subprocess(args).returncode == 0
    full = time.time() - t0
    before = _snapshot(out)
    t0 = time.time()
    again = run_subprocess(args)
    took = time.time() - t0
    assert again.returncode == 0, again.stderr[-2000:]
    assert "is already complete" in again.stderr and "nothing to do" in again.stderr
    assert _snapshot(out) == before            # no pipeline ran: nothing staged, nothing rewritten (no timing asserted)
    other = run_subprocess(argv(tiny_model_files, corpus, out, *SMALL, "--layers", "top"))
    assert other.returncode == 2 and "pass --overwrite" in other.stderr
    assert _snapshot(out) == before
    print(f"full run {full:.1f} s, rerun of the finished command {took:.1f} s (process start included)")


def test_on_s3_concurrent_runs_and_finished_reruns(corpus, tiny_model_files, reference, tmp_path):
    """(5) The same on moto's S3 server on loopback: the lease is a conditional PUT (If-None-Match), a second
    run exits 75 naming the holder, the first completes; rerunning it changes no object."""
    with moto_s3("elmo-lease") as (endpoint, fs):
        fs.put_file(corpus, "elmo-lease/in/docs.txt")
        s3 = ("--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing")
        args = argv(tiny_model_files, "s3://elmo-lease/in/docs.txt", "s3://elmo-lease/out", *SMALL, *s3)

        def lease_exists():
            fs.invalidate_cache()
            return fs.exists("elmo-lease/out/_lease.json")
        go = tmp_path / "go"
        first = _start(args, hold=go)
        try:
            _wait_for(lease_exists, what="the first run's lease")
            holder = json.loads(fs.cat_file("elmo-lease/out/_lease.json"))
            second = run_subprocess(args)
            assert first.poll() is None, "the first run ended before the second had"
            assert second.returncode == 75 and f"held by a live run: pid {first.pid}" in second.stderr, \
                second.stderr[-2000:]
            assert json.loads(fs.cat_file("elmo-lease/out/_lease.json"))["token"] == holder["token"]
            go.touch()
            _, err = first.communicate(timeout=240)
        finally:
            first.kill()
        assert first.returncode == 0, err[-2000:]
        got = read_output("s3://elmo-lease/out", fs)
        assert_same_output(got, reference)
        fs.invalidate_cache()
        assert not fs.exists("elmo-lease/out/_lease.json")

        def objects():
            fs.invalidate_cache()
            return {p: (i["ETag"], i["LastModified"]) for p, i in fs.find("elmo-lease/out", detail=True).items()}
        before = objects()
        again = run_subprocess(args)
        assert again.returncode == 0 and "is already complete" in again.stderr, again.stderr[-2000:]
        assert objects() == before


S3_FLAGS = ("--s3_endpoint_url", "{endpoint}", "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing")


def _s3_args(tiny_model_files, endpoint, bucket, *extra):
    s3 = [f.format(endpoint=endpoint) for f in S3_FLAGS]
    return argv(tiny_model_files, f"s3://{bucket}/in/docs.txt", f"s3://{bucket}/out", *SMALL, *extra, *s3)


def test_on_s3_a_killed_runs_lease_is_taken_over_when_stale(corpus, tiny_model_files, reference):
    """(2) on S3: the holder is SIGKILLed and its lease object rewritten as another host's (a lost machine);
    a rerun is refused while that heartbeat is fresh and takes the lease over (If-Match on its ETag) once it
    is older than --lease-stale-seconds; the output equals an uninterrupted run's."""
    with moto_s3("elmo-stale") as (endpoint, fs):
        fs.put_file(corpus, "elmo-stale/in/docs.txt")
        args = _s3_args(tiny_model_files, endpoint, "elmo-stale", "--lease-stale-seconds", "10")
        p = run_subprocess(args, "embed:3")
        assert p.returncode == -9, p.stderr[-2000:]
        fs.invalidate_cache()
        lease = json.loads(fs.cat_file("elmo-stale/out/_lease.json"))
        lease.update(host="a-lost-machine", heartbeat=time.time())     # its last heartbeat: just now
        fs.pipe_file("elmo-stale/out/_lease.json", json.dumps(lease).encode())
        early = run_subprocess(args)
        assert early.returncode == 75 and "on host a-lost-machine" in early.stderr, early.stderr[-2000:]
        assert "older than 10 s (--lease-stale-seconds)" in early.stderr
        fs.invalidate_cache()
        assert json.loads(fs.cat_file("elmo-stale/out/_lease.json"))["token"] == lease["token"]
        lease.update(heartbeat=time.time() - 10.5)     # no heartbeat since: 10.5 s ago, past the stale age
        fs.pipe_file("elmo-stale/out/_lease.json", json.dumps(lease).encode())
        late = run_subprocess(args)
        assert late.returncode == 0, late.stderr[-2000:]
        assert "took over a stale lease: pid" in late.stderr and "a-lost-machine" in late.stderr
        got = read_output("s3://elmo-stale/out", fs)
        assert_same_output(got, reference)
        assert got[0]["run"]["resumed_sentences"] > 0
        fs.invalidate_cache()
        assert not fs.exists("elmo-stale/out/_lease.json")


def test_on_s3_a_finalize_plan_with_a_lost_object_is_healed_by_a_rerun(corpus, tiny_model_files, reference):
    """(3) on S3: Finalize killed after 3 moves (server-side copy + delete), then a staged object of its plan
    is deleted: the rerun rolls the plan back, re-embeds that shard and completes equal to an uninterrupted
    run."""
    with moto_s3("elmo-heal") as (endpoint, fs):
        fs.put_file(corpus, "elmo-heal/in/docs.txt")
        args = _s3_args(tiny_model_files, endpoint, "elmo-heal")
        p = run_subprocess(args, "finalize_move:3")
        assert p.returncode == -9, p.stderr[-2000:]
        fs.invalidate_cache()
        (st,) = fs.ls("elmo-heal/out/_staging")
        plan = json.loads(fs.cat_file(f"{st}/finalize.json"))
        lost_name = next(src for src, _ in plan["moves"][3:] if src.endswith(".parquet"))   # named inside st
        lost = f"{st}/{lost_name}"
        fs.rm_file(lost)
        fs.invalidate_cache()
        assert all(fs.exists(f"elmo-heal/out/{rel}") for _, rel in plan["moves"][:3])
        assert not fs.exists(lost)
        rerun = run_subprocess(args)
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert "rolling it back" in rerun.stderr
        got = read_output("s3://elmo-heal/out", fs)
        assert_same_output(got, reference)
        lost_sentences = next(s["sentences"] for s in plan["manifest"]["shards"] if s["parquet"] in
                              {rel for src, rel in plan["moves"] if src == lost_name})
        assert got[0]["run"]["resumed_sentences"] == reference[0]["counts"]["sentences_written"] - lost_sentences
        fs.invalidate_cache()
        assert not fs.exists("elmo-heal/out/_lease.json")


def test_overwrite_redoes_a_finished_run_of_the_same_command(corpus, tiny_model_files, reference, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *SMALL)
    assert main(args) == 0
    first = os.stat(os.path.join(out, "_SUCCESS")).st_mtime_ns
    assert main([*args, "--overwrite"]) == 0
    assert "already complete" not in capsys.readouterr().err
    assert os.stat(os.path.join(out, "_SUCCESS")).st_mtime_ns > first
    assert_same_output(read_output(out), reference)
