"""The pipeline on Beam's DaskRunner against a dask.distributed LocalCluster (2 worker processes on
127.0.0.1, started and stopped here): the same output as FnApiRunner, and a worker process SIGKILLed
mid-run, then the same command rerun, gives what an uninterrupted run gives."""
import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import robustness_corpus as rc
from tests.resume_helpers import REPO, argv, assert_same_output, read_output, run_subprocess, write_corpus

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes

DASK = "apache_beam.runners.dask.dask_runner.DaskRunner"
DIRTY = ("invalid_utf8.txt", "controls.txt", "nul.txt", "crlf.txt", "bom.txt", "blank_lines.txt", "empty.txt")
EXTRA = ("--shard-sentences", "8", "--max-tokens-per-batch", "256", "--max-sentence-tokens", "24")


def dirty_corpus(folder) -> str:
    """Raw text with several sentences per document (docs.txt) plus dirty files (invalid UTF-8, control
    characters, NULs, CRLF, a BOM, blank lines, an empty file); returns a glob of them."""
    os.makedirs(folder, exist_ok=True)
    write_corpus(os.path.join(folder, "docs.txt"), n_docs=24, seed=3)
    cases = rc.generated_cases()
    for name in DIRTY:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(cases[name])
    return os.path.join(str(folder), "*.txt")


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster
    # each batch takes 0.3 s longer on the workers, so that a worker can be killed while it embeds
    c = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                     env={"ELMO_PIPELINE_DELAY_AT": "embed:0.3", "OMP_NUM_THREADS": "1"})
    client = Client(c.scheduler_address)
    yield c, client
    client.close()
    c.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return dirty_corpus(tmp_path_factory.mktemp("dirty"))


@pytest.fixture(scope="module")
def reference(corpus, tiny_model_files, tmp_path_factory):
    from elmo_pipeline.pipeline.run import main
    out = str(tmp_path_factory.mktemp("fnapi") / "out")
    assert main(argv(tiny_model_files, corpus, out, *EXTRA)) == 0
    ref = read_output(out)
    c = ref[0]["counts"]
    assert c["record_dead_letters"] >= 4 and c["dead_letter_sentences"] >= 3 and c["blank_records"] >= 5
    assert c["sentences_written"] > 40 and c["documents"] > 30
    return ref


def _dask_args(model, corpus, out, cluster):
    return argv(model, corpus, out, *EXTRA, "--runner", DASK, "--dask_client_address", cluster.scheduler_address,
                "--dask_npartitions", "4")


def test_dask_equals_fnapi(cluster, corpus, tiny_model_files, reference, tmp_path):
    """Same ids, tokens, offsets, manifest counts and dead letters; vectors within 1e-6 (Parquet and HDF5)."""
    out = str(tmp_path / "out")
    p = run_subprocess(_dask_args(tiny_model_files, corpus, out, cluster[0]), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_output(out)
    assert_same_output(got, reference)
    assert got[0]["run"]["key"] == reference[0]["run"]["key"]
    from elmo_pipeline.model.kernels import kernel_difference     # planned as null: the workers recorded theirs
    assert isinstance(got[0]["kernel_path"], dict) and "worker_kernel_paths" not in got[0]
    assert kernel_difference(got[0]["kernel_path"], reference[0]["kernel_path"]) is None
    assert "dead letters" in p.stderr and "batches" not in p.stderr.splitlines()[-1]   # no metrics on Dask


def test_dask_worker_killed_then_rerun(cluster, corpus, tiny_model_files, reference, tmp_path):
    """A worker process is SIGKILLed while the run embeds; Dask's nanny restarts it and the lost tasks run
    again (finished ones too: their shards are staged twice). The same command is then rerun."""
    c, client = cluster
    out = str(tmp_path / "out")
    args = _dask_args(tiny_model_files, corpus, out, c)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not glob.glob(os.path.join(out, "_staging", "*", "committed", "*.json")):
            assert run.poll() is None and time.time() - t0 < 60, "no shard was committed"
            time.sleep(0.05)
        pids = client.run(os.getpid)
        busy = [w for w, tasks in client.processing().items() if tasks]
        assert busy, "no worker is processing a task"
        victim = pids[busy[0]]
        os.kill(victim, signal.SIGKILL)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode in (0, 2), err[-3000:]
    client.wait_for_workers(2, timeout=30)
    assert victim not in client.run(os.getpid).values()
    rerun = run_subprocess(args, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    got = read_output(out)
    assert_same_output(got, reference)
    print(f"first run: rc {run.returncode}; rerun: {rerun.stderr.strip().splitlines()[-1]}")


@contextlib.contextmanager
def cli_cluster(tmp_path, *worker_envs: dict, nworkers: int = 1):
    """`dask scheduler` and one `dask worker --nworkers N` process per env in worker_envs (added to this one's, with
    OMP_NUM_THREADS=1), all on 127.0.0.1; yields the scheduler's address once every worker has joined; stopped after."""
    import json
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    info = str(tmp_path / "scheduler.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", info], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        t0 = time.time()
        while not os.path.exists(info):
            assert time.time() - t0 < 30, "the scheduler did not start"
            time.sleep(0.1)
        for extra in worker_envs:
            procs.append(subprocess.Popen([dask, "worker", "--scheduler-file", info, "--nworkers", str(nworkers),
                                           "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                                          env={**env, **extra}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        from distributed import Client
        address = json.load(open(info))["address"]
        with Client(address) as client:
            client.wait_for_workers(nworkers * len(worker_envs), timeout=60)
        yield address
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):   # a process the test killed itself
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_dask_cli_cluster_commands(corpus, tiny_model_files, reference, tmp_path):
    """README "A Dask cluster": `dask scheduler` and `dask worker --nworkers 2` on 127.0.0.1, then
    `python -m elmo_pipeline.pipeline.run --runner ...DaskRunner --dask_client_address ...`."""
    with cli_cluster(tmp_path, {}, nworkers=2) as address:
        out = str(tmp_path / "out")
        p = run_subprocess(argv(tiny_model_files, corpus, out, *EXTRA, "--runner", DASK, "--dask_client_address",
                                address, "--dask_npartitions", "4"), timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        assert_same_output(read_output(out), reference)


def _run_to_a_commit(args: list[str], out: str, address: str):
    """(the run's process, its scheduler's pid) once the run, started on the cluster at `address`, has committed a
    shard of `out`."""
    from distributed import Client
    with Client(address) as client:
        scheduler = client.run_on_scheduler(os.getpid)
    run = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    t0 = time.time()
    while not glob.glob(os.path.join(out, "_staging", "*", "committed", "*.json")):
        if run.poll() is not None or time.time() - t0 > 60:
            run.kill()
            raise AssertionError("no shard was committed")
        time.sleep(0.05)
    return run, scheduler


def test_dask_scheduler_killed_mid_run_publishes_nothing_and_a_rerun_finishes(corpus, tiny_model_files, reference,
                                                                             tmp_path):
    """The scheduler SIGKILLed while the run embeds: Beam's DaskRunner ended its wait as DONE (its tasks' futures
    cancelled, whose CancelledError distributed's as_completed yields unraised), and Finalize published what was
    staged so far, a manifest short of most sentences that a rerun then finished as complete. Now: exit 70, one
    error line, no manifest; the same command on a new cluster gives what an uninterrupted run gives."""
    out = str(tmp_path / "out")
    (tmp_path / "c1").mkdir()
    (tmp_path / "c2").mkdir()
    with cli_cluster(tmp_path / "c1", {"ELMO_PIPELINE_DELAY_AT": "embed:0.5"}) as address:
        args = argv(tiny_model_files, corpus, out, *EXTRA, "--runner", DASK, "--dask_client_address", address,
                    "--dask_npartitions", "4")
        run, scheduler = _run_to_a_commit(args, out, address)
        try:
            os.kill(scheduler, signal.SIGKILL)
            _, err = run.communicate(timeout=120)
        finally:
            run.kill()
    assert run.returncode == 70, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rerun the same command" in errors[0], err[-3000:]
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    with cli_cluster(tmp_path / "c2", {}) as address:
        rerun = run_subprocess(argv(tiny_model_files, corpus, out, *EXTRA, "--runner", DASK, "--dask_client_address",
                                    address, "--dask_npartitions", "4"), timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_output(read_output(out), reference)


def test_dask_scheduler_that_never_answers_is_retry_later(tiny_model_files, tmp_path):
    """A --dask_client_address that accepts connections and never answers (a scheduler stopped or frozen, another
    service on its port): distributed's Client bounds the connect, not the handshake, and the run waited for good,
    its lease alive (every later run 75). Now: exit 75 after --dask_connection_timeout, one line, the lease given
    back."""
    import socket
    import threading
    path = write_corpus(str(tmp_path / "in.txt"), n_docs=4)
    out = str(tmp_path / "out")
    silent, held, stop = socket.socket(), [], threading.Event()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(0.2)

    def accept():
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(silent.accept()[0])
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        p = run_subprocess(argv(tiny_model_files, path, out, "--runner", DASK, "--dask_client_address",
                                f"tcp://127.0.0.1:{silent.getsockname()[1]}", "--dask_connection_timeout", "3"),
                           timeout=90)
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        silent.close()
    assert held, "the run never connected"
    assert p.returncode == 75, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "did not answer within 3 s" in errors[0], p.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "_lease.json"))


def test_dask_scheduler_stopped_mid_run_is_retry_later_and_a_rerun_finishes(corpus, tiny_model_files, reference,
                                                                             tmp_path):
    """The scheduler SIGSTOPped while the run embeds (frozen: its connections stay open): the run waited for good,
    its lease alive. Now the scheduler is asked to answer every --dask_connection_timeout: exit 75, one line, the
    lease given back; once it runs again (SIGCONT) the same command finishes the output."""
    out = str(tmp_path / "out")
    (tmp_path / "c").mkdir()
    with cli_cluster(tmp_path / "c", {"ELMO_PIPELINE_DELAY_AT": "embed:0.5"}) as address:
        args = argv(tiny_model_files, corpus, out, *EXTRA, "--runner", DASK, "--dask_client_address", address,
                    "--dask_npartitions", "4", "--dask_connection_timeout", "3")
        run, scheduler = _run_to_a_commit(args, out, address)
        try:
            os.kill(scheduler, signal.SIGSTOP)
            try:
                _, err = run.communicate(timeout=60)
            finally:
                os.kill(scheduler, signal.SIGCONT)
        finally:
            run.kill()
        assert run.returncode == 75, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "did not answer within 3 s" in errors[0], err[-3000:]
        assert not os.path.exists(os.path.join(out, "_lease.json"))
        rerun = run_subprocess(args, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_output(read_output(out), reference)


def test_dask_workers_on_two_kernel_paths_are_both_recorded_and_not_claimed_exact(tiny_model_files, tmp_path):
    """Two `dask worker` processes, one with ELMO_LSTM_GEMM=onednn (another LSTM loop: other bits), a
    --batch-invariant run (--dedupe on, planned exact): a run that embedded on both records no one `kernel_path` but
    both paths in `worker_kernel_paths`, and --dedupe not exact; one that embedded on one worker names its path.
    Of up to three runs, one must embed on both."""
    from elmo_pipeline.model.kernels import kernel_difference
    path = write_corpus(str(tmp_path / "one.txt"), n_docs=300, seed=5)
    delay = {"ELMO_PIPELINE_DELAY_AT": "embed:0.3"}
    with cli_cluster(tmp_path, delay, {**delay, "ELMO_LSTM_GEMM": "onednn"}) as address:
        for attempt in range(3):
            out = str(tmp_path / f"out{attempt}")
            p = run_subprocess(argv(tiny_model_files, path, out, *EXTRA, "--batch-invariant", "--split-bytes", "2500",
                                    "--runner", DASK, "--dask_client_address", address), timeout=180)
            assert p.returncode == 0, p.stderr[-3000:]
            m = read_output(out)[0]
            if m["kernel_path"] is not None:
                assert "worker_kernel_paths" not in m and m["dedupe"]["exact"] is True
                continue
            loops = sorted(k["lstm_loop"][0] for k in m["worker_kernel_paths"])
            assert loops == ["bmm", "onednn"] and m["dedupe"]["exact"] is False
            assert kernel_difference(*m["worker_kernel_paths"]).startswith("LSTM loop")
            return
    pytest.fail("no run embedded on both workers")


def test_dask_one_file_spreads_over_both_workers(tiny_model_files, tmp_path):
    """One file, no --dask_npartitions: read in parts, one partition each, documents spread by key; both workers
    embed (tasks as long as a delayed batch on each) and the output equals FnApiRunner's reading the file whole.
    On a fresh cluster of its own: on a warm one Dask's scheduler may place a small run's tasks on one worker
    (docs/scaling-out.md). Of up to three runs, every one must equal the reference and one must embed on both."""
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster, get_task_stream
    from elmo_pipeline.pipeline.run import main
    c = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                     env={"ELMO_PIPELINE_DELAY_AT": "embed:0.3", "OMP_NUM_THREADS": "1"})
    client = Client(c.scheduler_address)
    try:
        path = write_corpus(str(tmp_path / "one.txt"), n_docs=500, seed=11)
        ref_out = str(tmp_path / "ref")
        assert main(argv(tiny_model_files, path, ref_out, *EXTRA, "--split-bytes", "-1")) == 0
        placements = []
        for attempt in range(3):
            out = str(tmp_path / f"out{attempt}")
            with get_task_stream(client) as ts:
                p = run_subprocess(argv(tiny_model_files, path, out, *EXTRA, "--split-bytes", "2500", "--runner", DASK,
                                        "--dask_client_address", c.scheduler_address), timeout=180)
            assert p.returncode == 0, p.stderr[-3000:]
            assert_same_output(read_output(out), read_output(ref_out))
            placements.append({t["worker"] for t in ts.data for s in t["startstops"]
                               if s["action"] == "compute" and s["stop"] - s["start"] >= 0.3})
            if len(placements[-1]) == 2:
                break
    finally:
        client.close()
        c.close()
    assert len(placements[-1]) == 2, placements
