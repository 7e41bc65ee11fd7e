"""A command's result never depends on whether anyone reads its logs (pipeline/streams.py,
docs/scheduling.md#logs-nobody-reads): with stdout or stderr a pipe nobody reads any more, or closed, a run exits
with its work's status and writes its output and --metrics-file; what it prints is dropped. Ctrl-C while the
command is still importing is one `error:` line and 130; a tokenizer child whose reader is gone exits quietly."""
import io
import json
import os
import pickle
import subprocess
import sys

import pytest

from elmo_pipeline.pipeline import exits
from elmo_pipeline.pipeline.streams import Unread, say
from elmo_pipeline.tokenization.process import serve
from tests.resume_helpers import REPO, argv, write_corpus


def _unread_pipe():
    """The write end of a pipe whose read end is closed: every write to it fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_a_stream_nobody_reads_drops_what_is_written():
    w = _unread_pipe()
    stream = Unread(open(w, "w", buffering=1))
    stream.write("a line nobody reads\n")
    stream.flush()
    print("and another", file=stream)
    say("said to nobody", stream)
    stream.stream.close()        # what it still buffered went to os.devnull: no error at close either


def test_say_on_an_unguarded_stream_nobody_reads():
    raw = open(_unread_pipe(), "w")
    say("dropped", raw)
    say("nothing at all", None)


def test_a_broken_connection_to_storage_is_still_retry_later():
    """EPIPE raised by storage (a connection) stays transient: only the command's own streams drop theirs."""
    assert exits.classify(BrokenPipeError(32, "Broken pipe")).status == exits.TEMPFAIL


def test_a_tokenizer_child_whose_reader_is_gone_returns_quietly():
    chunk = io.BytesIO(pickle.dumps([("One sentence. Two.", True)], protocol=5))
    out = open(_unread_pipe(), "wb")
    serve("wikitext", chunk, out)          # raised BrokenPipeError
    out.close()


# ---------------------------------------------------------------- processes
def _run(args, module="elmo_pipeline", stdout=None, stderr=None, shell_suffix=""):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", module, *args]
    if shell_suffix:
        cmd = ["bash", "-c", " ".join(f"'{a}'" for a in cmd) + " " + shell_suffix]
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, timeout=300)


def _status(path):
    return [line for line in open(path) if line.startswith("elmo_pipeline_exit_status")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "docs.txt"), n_docs=4, seed=3)


@pytest.mark.slow
def test_run_rerun_and_bad_flag_with_nobody_reading(corpus, tiny_model_files, tmp_path):
    out, metrics = str(tmp_path / "out"), tmp_path / "m.prom"
    args = ["run", *argv(tiny_model_files, corpus, out), "--metrics-file", str(metrics)]
    for attempt in ("run", "already complete"):
        metrics.unlink(missing_ok=True)
        w = _unread_pipe()
        p = _run(args, stdout=w, stderr=w)
        os.close(w)
        assert p.returncode == 0, attempt
        assert os.path.exists(os.path.join(out, "_SUCCESS")) and _status(metrics) and \
            _status(metrics)[0].split()[-1] == "0", attempt
    w = _unread_pipe()
    p = _run(["run", *argv(tiny_model_files, corpus, str(tmp_path / "o2")), "--bogus", "--metrics-file",
              str(metrics)], stdout=w, stderr=w)
    os.close(w)
    assert p.returncode == 2 and _status(metrics)[0].split()[-1] == "2"


@pytest.mark.slow
def test_plan_and_models_into_a_reader_gone_exit_0(corpus, tiny_model_files, tmp_path):
    for module, args in (("elmo_pipeline", ["plan", *argv(tiny_model_files, corpus, str(tmp_path / "o"))]),
                         ("elmo_pipeline.pipeline.run", ["--dry-run", *argv(tiny_model_files, corpus, str(tmp_path / "o"))]),
                         ("elmo_pipeline", ["models"])):
        w = _unread_pipe()
        p = _run(args, module, stdout=w, stderr=subprocess.PIPE)
        os.close(w)
        assert p.returncode == 0, (module, args[0], p.stderr[-2000:])
        assert b"Traceback" not in p.stderr and b"Broken pipe" not in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.slow
@pytest.mark.parametrize("module", ["elmo_pipeline", "elmo_pipeline.pipeline.run"])
def test_run_with_stderr_closed_exits_0(module, corpus, tiny_model_files, tmp_path):
    out = str(tmp_path / "out")
    args = (["run"] if module == "elmo_pipeline" else []) + [
        a for a in argv(tiny_model_files, corpus, out) if a not in ("--progress", "off")]    # progress auto: isatty
    p = _run(args, module, stdout=subprocess.PIPE, shell_suffix="2>&-")
    assert p.returncode == 0 and os.path.exists(os.path.join(out, "_SUCCESS")), p.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to fails ENOSPC)")
def test_logs_on_a_full_disk_are_dropped_and_a_plan_that_cannot_be_written_is_75(corpus, tiny_model_files, tmp_path):
    """stderr on a full disk (/dev/full): the run's logs are dropped, its status its work's (0) and its
    --metrics-file written; `plan` whose stdout (its product) is on a full disk: one error line, 75 (retry later),
    never a traceback."""
    out, metrics = str(tmp_path / "out"), tmp_path / "m.prom"
    with open("/dev/full", "w") as full:
        p = _run(["run", *argv(tiny_model_files, corpus, out), "--metrics-file", str(metrics)], stderr=full)
    assert p.returncode == 0 and os.path.exists(os.path.join(out, "_SUCCESS")) and \
        _status(metrics)[0].split()[-1] == "0"
    with open("/dev/full", "w") as full:
        p = _run(["plan", *argv(tiny_model_files, corpus, str(tmp_path / "o"))], stdout=full, stderr=subprocess.PIPE)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 75 and lines[-1].startswith("error: ") and "Traceback" not in p.stderr.decode(), lines


@pytest.mark.slow
@pytest.mark.parametrize("module", ["elmo_pipeline", "elmo_pipeline.pipeline.run"])
def test_ctrl_c_while_importing_is_one_line_and_130(module, tmp_path):
    """KeyboardInterrupt raised as the command imports Beam (where a Ctrl-C in its first seconds lands)."""
    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'apache_beam':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            f"sys.argv = ['x', *sys.argv[1:]]\n"
            f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    args = (["run"] if module == "elmo_pipeline" else []) + ["--input", "x.txt", "--output", str(tmp_path / "o")]
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == exits.INTERRUPTED, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == \
        ["error: KeyboardInterrupt (exit 130: interrupted)"], p.stderr


@pytest.mark.slow
def test_a_tokenizer_child_whose_parent_is_gone_prints_no_traceback():
    child = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.tokenization.process", "wikitext"], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()                    # its reader, the parent's thread, gone
    pickle.dump([("One sentence. Two.", True)] * 50, child.stdin, protocol=5)
    child.stdin.close()
    err = child.stderr.read()
    assert child.wait(timeout=60) == 0 and not err, err


@pytest.mark.slow
def test_worker_processes_whose_log_reader_goes_away_finish_the_run(tiny_model_files, tmp_path):
    """--progress on with local worker processes (multi_processing): each worker writes its bar to the stderr it
    inherited. The reader of that pipe exits once the bars have started (`2>&1 | head -c 200`): the workers' bars
    are dropped (fsio/streams.py Unread), the run finishes and exits 0 (a worker's bar raising EPIPE held the run
    forever)."""
    import random
    import time
    rng = random.Random(0)
    words = "the a of harbour boats stayed home new page another cat dog ran".split()
    inp, out = tmp_path / "in.txt", tmp_path / "out"
    inp.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 20))) + " .\n"
                           for _ in range(3000)), encoding="utf-8")
    options, weights = tiny_model_files
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.run", "--input", str(inp), "--output", str(out),
           "--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "on",
           "--tokenizer", "whitespace", "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
    p = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    seen, t0 = b"", time.time()
    while b"embedding, pid" not in seen:
        chunk = os.read(p.stderr.fileno(), 4096)
        assert chunk and time.time() - t0 < 120, seen[-2000:]
        seen += chunk
    p.stderr.close()                                # the reader is gone while the workers' bars are being written
    try:
        assert p.wait(timeout=120) == 0
    finally:
        p.kill()
    assert json.load(open(out / "manifest.json"))["counts"]["sentences_written"] == 3000
