"""Exit statuses a scheduler acts on (pipeline/exits.py, docs/failure-behaviour.md#exit-statuses), each from a
real `python -m elmo_pipeline.pipeline.run` process: a bad flag (2), bad model files (65), a live run holding the lease (75),
a full disk (a small tmpfs, 75; the rerun after space was freed resumes and matches an uninterrupted run) and an
unreachable S3 endpoint (moto's server, stopped: 75). Every failure prints one line `error: ...` and no
traceback unless --verbose. Plus the mapping itself on a full disk inside a real Beam pipeline (FnApiRunner)."""
import errno
import os
import shutil
import subprocess
import sys

import apache_beam as beam
import pytest

from elmo_pipeline.output.lease import Lease
from elmo_pipeline.pipeline import exits
from tests.pipeline_helpers import moto_s3
from tests.resume_helpers import REPO, argv, assert_same_output, read_output, run_subprocess, write_corpus


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _one_line(p, status: int, *words: str) -> str:
    """The process exited `status` with exactly one `error:` line holding `words`, and no traceback."""
    assert p.returncode == status, p.stderr[-3000:]
    (line,) = _error_lines(p.stderr)
    assert f"(exit {status}: " in line and all(w in line for w in words), line
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "docs.txt"), n_docs=12, seed=3)


# ---------------------------------------------------------------- the mapping (no process)
class _Full(beam.DoFn):
    def process(self, x):
        raise OSError(errno.ENOSPC, "No space left on device", "/full/shard.parquet")


def test_a_full_disk_under_beams_wrapping_is_retry_later():
    with pytest.raises(Exception) as info:
        with beam.Pipeline(runner="FnApiRunner") as p:
            _ = p | beam.Create([1]) | "EmbedShards" >> beam.ParDo(_Full())
    f = exits.classify(info.value)
    assert f.status == exits.TEMPFAIL and "No space left on device" in f.message, (f, repr(info.value))
    assert "EmbedShards" in f.message


@pytest.mark.parametrize("exc, status", [
    (ValueError("--dtype: invalid choice"), exits.USAGE),
    (FileExistsError("out holds a finished run of a different command"), exits.USAGE),
    (FileNotFoundError("input 'x/*.txt' matches no file"), exits.DATA),
    (RuntimeError("OSError: [Errno 28] No space left on device [while running 'EmbedShards']"), exits.TEMPFAIL),
    (RuntimeError("Traceback (most recent call last):\n  File x\nOSError: [Errno 122] Disk quota exceeded"),
     exits.TEMPFAIL),
    (ConnectionResetError(errno.ECONNRESET, "reset"), exits.TEMPFAIL),
    (KeyError("a bug"), exits.SOFTWARE),
    (RuntimeError("Traceback (most recent call last):\n  File x\nelmo_pipeline.transforms.reuse.ReuseError: --reuse s: "
                  "p.parquet: not the file its manifest records [while running 'Reuse']"), exits.USAGE),
    (KeyboardInterrupt(), exits.INTERRUPTED),
    (exits.Terminated("SIGTERM"), exits.TERMINATED),
])
def test_classify(exc, status):
    assert exits.classify(exc).status == status


def test_a_value_error_after_planning_is_no_bad_flag():
    e = ValueError("Unable to create dataset (name already exists)")
    exits.after_plan(e)
    assert exits.classify(e).status == exits.SOFTWARE


def test_a_reuse_source_found_damaged_by_a_worker_exits_as_while_planning():
    """A --reuse source's ReuseError (a shard not the recorded file) raised as a worker reads it, under Beam's
    wrapping and after planning: USAGE, as the same source found damaged while planning (docs/failure-behaviour.md);
    one whose cause says storage failed (s3fs's InternalError, an errno no list knows): TEMPFAIL; a source's file
    gone: USAGE, its --reuse label kept."""
    from elmo_pipeline.transforms.reuse import KernelPathError, ReuseError
    for error in (ReuseError("--reuse s: part-0.parquet: not the file its manifest records"), KernelPathError("k")):
        try:
            try:
                raise error
            except ReuseError as inner:
                raise RuntimeError(f"{inner} [while running 'ReuseVectors']") from inner
        except RuntimeError as outer:
            exits.after_plan(outer)
            f = exits.classify(outer)
        assert f.status == exits.USAGE and f.message.startswith(str(error)) and "ReuseVectors" in f.message, f
    internal = "An error occurred (InternalError) when calling the GetObject operation: please try again."
    for cause, status in ((OSError(121, internal), exits.TEMPFAIL),
                          (FileNotFoundError(2, "No such file or directory", "s/keys/part-0.parquet"), exits.USAGE)):
        try:                            # open_source's wrapping while planning: the cause kept as the context
            try:
                raise cause
            except OSError as e:
                raise ReuseError(f"--reuse s: cannot read it ({type(e).__name__}: {e})") from None
        except ReuseError as e:
            f = exits.classify(e)
        assert f.status == status and f.message.startswith("--reuse s: cannot read it"), f
    # its own message quotes the source (untrusted: a folder named so) and says nothing of storage
    assert exits.classify(ReuseError("--reuse /data/Service Unavailable backup: no finished output there")).status \
        == exits.USAGE


def test_a_reuse_source_file_gone_as_a_worker_reads_it_is_a_reuse_error(tmp_path):
    """transforms/reuse.read_source_file: a source file gone since planning is the source's ReuseError (exit 2 with
    its label under Beam's wrapping), not a bare FileNotFoundError (65)."""
    from elmo_pipeline.transforms.reuse import ReuseError, read_source_file
    gone = str(tmp_path / "keys" / "part-00000-of-00001.parquet")
    with pytest.raises(ReuseError, match="gone since the run was planned") as info:
        read_source_file(gone, {"bytes": 3, "sha256": "a" * 64}, None)
    try:
        raise RuntimeError(f"{info.value} [while running 'ReuseVectors']") from info.value
    except RuntimeError as outer:
        exits.after_plan(outer)
        f = exits.classify(outer)
    assert f.status == exits.USAGE and f.message.startswith(f"--reuse: {gone}: gone since"), f


# ---------------------------------------------------------------- real processes


@pytest.mark.slow
def test_bad_flag_exits_2_in_one_line_traceback_only_with_verbose(corpus, tiny_model_files, tmp_path):
    out = str(tmp_path / "out")
    p = run_subprocess(argv(tiny_model_files, corpus, out, "--max-sentence-token", "5"))
    _one_line(p, exits.USAGE, "unknown flag(s): --max-sentence-token")
    cli = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.cli", "run", *argv(tiny_model_files, corpus, out,
                                                                                "--dtype", "float64")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    _one_line(cli, exits.USAGE, "--dtype")
    verbose = run_subprocess(argv(tiny_model_files, corpus, out, "--dtype", "float64", "--verbose"))
    assert verbose.returncode == exits.USAGE and "Traceback" in verbose.stderr
    assert len(_error_lines(verbose.stderr)) == 1
    assert not os.path.exists(out)


@pytest.mark.slow
def test_bad_model_files_exit_65(corpus, tiny_model_files, tmp_path):
    options, weights = tiny_model_files
    bad = str(tmp_path / "weights.hdf5")
    with open(weights, "rb") as f, open(bad, "wb") as g:
        g.write(f.read()[:1000])
    p = run_subprocess(argv((options, bad), corpus, str(tmp_path / "out")))
    _one_line(p, exits.DATA, "WeightsError", "not a valid HDF5 file")


@pytest.mark.slow
def test_a_live_runs_lease_exits_75_and_the_metrics_file_says_so(corpus, tiny_model_files, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    out = tmp_path / "out"
    out.mkdir()
    metrics = tmp_path / "collector" / "elmo.prom"
    metrics.parent.mkdir()
    with Lease(str(out / "_lease.json"), 60):            # held by this (live) process, heartbeat running
        p = run_subprocess(argv(tiny_model_files, corpus, str(out), "--metrics-file", str(metrics)))
    _one_line(p, exits.TEMPFAIL, "is held by a live run", f"pid {os.getpid()}", "retry later")
    assert sorted(os.listdir(out)) == []                 # the lease went with its holder; nothing else written
    fams = {f.name: f for f in text_string_to_metric_families(metrics.read_text())}
    (sample,) = fams["elmo_pipeline_exit_status"].samples
    assert sample.value == exits.TEMPFAIL and sample.labels == {"output": str(out)}
    assert os.listdir(metrics.parent) == ["elmo.prom"]    # written by rename: no temporary file left


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (pipeline/workers.py's _children, level by level)."""
    from elmo_pipeline.pipeline.workers import _children
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie left to a container's init that reaps nothing does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_sigterm_mid_run_exits_143_gives_the_lease_back_and_the_rerun_resumes(tiny_model_files, tmp_path):
    """A real run sent SIGTERM (a scheduler's cancel, a pod's stop) once it has committed a shard: one `error:` line
    and 143 (it died by the signal before), --metrics-file says 143, the output's lease is given back (a rerun on
    another machine need not wait for it to go stale), no process of it is left; the same command then finishes,
    equal to an uninterrupted run."""
    import glob
    import signal
    import time
    from prometheus_client.parser import text_string_to_metric_families
    big = write_corpus(str(tmp_path / "big.txt"), n_docs=4000, seed=5)
    out, metrics = tmp_path / "out", tmp_path / "elmo.prom"
    extra = ("--shard-sentences", "50", "--max-tokens-per-batch", "512")
    args = argv(tiny_model_files, big, str(out), *extra, "--metrics-file", str(metrics))
    p = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 180
        while p.poll() is None and not glob.glob(str(out / "_staging" / "*" / "committed" / "*.json")):
            assert time.monotonic() < deadline, "no shard committed in 180 s"
            time.sleep(0.05)
        assert p.poll() is None, "the run ended before it was sent SIGTERM"
        children = _descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    _one_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), exits.TERMINATED,
              "Terminated: SIGTERM", "terminated")
    assert children and not os.path.exists(out / "_lease.json") and os.path.isdir(out / "_staging")
    (sample,) = {f.name: f for f in text_string_to_metric_families(metrics.read_text())}[
        "elmo_pipeline_exit_status"].samples
    assert sample.value == exits.TERMINATED
    deadline = time.monotonic() + 30
    while any(map(_alive, children)):                 # its tokenizer children end with their pipes
        assert time.monotonic() < deadline, [c for c in children if _alive(c)]
        time.sleep(0.1)
    again = run_subprocess(args)
    assert again.returncode == 0, again.stderr[-3000:]
    ref = str(tmp_path / "ref")
    assert run_subprocess(argv(tiny_model_files, big, ref, *extra)).returncode == 0
    assert_same_output(read_output(str(out)), read_output(ref))


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [("SIGTERM", exits.TERMINATED), ("SIGINT", 130)])
def test_a_signal_as_local_workers_start_ends_the_run_and_its_workers(sig, status, tiny_model_files, corpus,
                                                                      tmp_path):
    """A multi-process run (--direct_running_mode multi_processing) sent SIGTERM or SIGINT (to the launcher alone: a
    scheduler's `kill PID`) as its worker processes start: one `error:` line and its status, the lease given back,
    no worker left (red team: Beam's cleanup waited for good for a worker not yet connected to the runner, the
    launcher alive and its lease beating, so every later run exited 75)."""
    import signal
    import time
    from elmo_pipeline.pipeline.workers import _children
    out = tmp_path / "out"
    args = argv(tiny_model_files, corpus, str(out), "--direct_num_workers", "2", "--direct_running_mode",
                "multi_processing")
    p = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    children = []
    try:
        deadline = time.monotonic() + 120
        while p.poll() is None and not children:      # the workers' shells, just started
            assert time.monotonic() < deadline, "no worker process started in 120 s"
            children = _children(p.pid)
            time.sleep(0.01)
        assert p.poll() is None, "the run ended before it was sent the signal"
        p.send_signal(getattr(signal, sig))
        stdout, stderr = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            for c in _descendants(p.pid):
                os.kill(c, signal.SIGKILL)
            p.kill()
            p.wait()
    _one_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), status)
    assert not os.path.exists(out / "_lease.json")
    deadline = time.monotonic() + 30
    while any(map(_alive, children)):
        assert time.monotonic() < deadline, [c for c in children if _alive(c)]
        time.sleep(0.1)


def _mount_tmpfs(path, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    if not shutil.which("mount"):
        pytest.skip("no mount command to make a small tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")


@pytest.mark.slow
def test_out_of_space_exits_75_and_the_rerun_after_freeing_space_resumes(corpus, tmp_path):
    """The shipped model's vectors (3 layers of 256 floats a token) do not fit a 256 KiB tmpfs: the run fails
    in EmbedShards with ENOSPC; grown to 64 MiB, the same command finishes, equal to a run on a roomy disk."""
    ref = str(tmp_path / "ref")
    common = ("--torch-threads", "1", "--progress", "off", "--max-tokens-per-batch", "512", "--shard-sentences", "8")
    assert run_subprocess(["--input", corpus, "--output", ref, *common]).returncode == 0
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "256k")
    try:
        args = ["--input", corpus, "--output", str(mnt / "out"), *common]
        p = run_subprocess(args)
        _one_line(p, exits.TEMPFAIL, "No space left on device", "retry later")
        r = subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        again = run_subprocess(args)
        assert again.returncode == 0, again.stderr[-3000:]
        assert_same_output(read_output(str(mnt / "out")), read_output(ref))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_an_unreachable_s3_endpoint_exits_75(corpus, tiny_model_files):
    with moto_s3("elmo-gone") as (endpoint, fs):
        fs.put_file(corpus, "elmo-gone/in/docs.txt")
    # the server has stopped: its endpoint refuses connections
    p = run_subprocess(argv(tiny_model_files, "s3://elmo-gone/in/docs.txt", "s3://elmo-gone/out",
                            "--s3-max-attempts", "2", "--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing",
                            "--s3_secret_access_key", "testing"))
    _one_line(p, exits.TEMPFAIL, "Could not connect to the endpoint URL", "retry later")


@pytest.mark.slow
@pytest.mark.parametrize("pip_status", [1, 2])
def test_run_pipeline_sh_whose_setup_fails_exits_70_with_one_line(pip_status, tmp_path):
    """./run_pipeline.sh whose scripts/bootstrap.sh fails (pip could not install: no network, a conflict) exits 70
    with one error line; it exited with pip's own status (1, undocumented; 2, read as a bad command line). A copy of
    the script beside a failing stand-in for bootstrap.sh: the real one is not run."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "run_pipeline.sh"), tmp_path / "run_pipeline.sh")
    stub = tmp_path / "scripts" / "bootstrap.sh"
    stub.write_text(f"#!/usr/bin/env bash\necho 'ERROR: No matching distribution found for torch' >&2\nexit {pip_status}\n")
    stub.chmod(0o755)
    p = subprocess.run([str(tmp_path / "run_pipeline.sh"), "--input", "x", "--output", "y"], capture_output=True,
                       text=True, timeout=60)
    _one_line(p, exits.SOFTWARE, "scripts/bootstrap.sh")
