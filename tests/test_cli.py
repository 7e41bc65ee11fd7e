"""The `elmo-pipeline` command line: only `run` imports Apache Beam, and a run's terminal output is ours."""
import logging
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_help_and_commands_other_than_run_import_no_beam():
    code = ("import sys\n"
            "from pipeline.cli import build_parser\n"
            "build_parser().parse_args(['train', 'x.txt', '--output', 'o'])\n"
            "import pipeline.elmo_command, pipeline.train_command, pipeline.evaluate_command\n"
            "import pipeline.export_command, pipeline.probe_command\n"
            "import training.train, training.export, model.embedder, tokenization\n"
            "import downstream.probe, downstream.readers\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    for args in ([], ["train"], ["elmo"], ["probe"], ["evaluate"], ["export"]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "elmo_pipeline.pipeline.cli", *args, "--help"],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0 and "usage: elmo-pipeline" in r.stdout
        assert "apache_beam" not in r.stderr, args


@pytest.mark.slow
def test_the_elmo_command_embeds_without_importing_beam(tmp_path, tiny_model_files):
    """The `elmo` command's fixed cost has no Beam in it (its checks are plain functions): a whole run, not --help."""
    (tmp_path / "in.txt").write_text("The cat sat .\n")
    code = ("import sys\n"
            "from elmo_pipeline.pipeline.cli import main\n"
            f"assert main(['elmo', {str(tmp_path / 'in.txt')!r}, {str(tmp_path / 'out.hdf5')!r}, '--all', "
            f"'--options-file', {tiny_model_files[0]!r}, '--weight-file', {tiny_model_files[1]!r}]) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", (r.stdout, r.stderr)


@pytest.mark.slow
def test_the_command_process_exits_with_its_status_its_file_whole_and_the_collector_frozen(tmp_path, tiny_model_files):
    """`python -m elmo_pipeline` (the console script's entry, cli.console): the subcommand's status is the process's,
    its HDF5 file is whole, and the objects alive after it are frozen out of the collector before the interpreter's
    exit (its collections over torch's objects otherwise cost every process about half a second); so is
    `python -m elmo_pipeline.pipeline.run`'s (cli.exit_with)."""
    import h5py
    (tmp_path / "in.txt").write_text("The cat sat .\nA dog .\n")
    out = tmp_path / "out.hdf5"
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
            "sys.argv[0] = 'elmo-pipeline'\n"
            "import runpy; runpy.run_module('elmo_pipeline', run_name='__main__')\n")
    args = ["elmo", str(tmp_path / "in.txt"), str(out), "--top", "--options-file", tiny_model_files[0],
            "--weight-file", tiny_model_files[1]]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "frozen True", (r.stdout, r.stderr)
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["0", "1", "sentence_to_index"] and f["0"].shape[0] == 4 and f["1"].shape[0] == 3
    r = subprocess.run([sys.executable, "-m", "elmo_pipeline", *args[:3], "--top", "--batch-size", "0"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "error: --batch-size must be >= 1", r.stderr
    code = code.replace("'elmo_pipeline'", "'elmo_pipeline.pipeline.run'")    # the pipeline's own entry too
    run = ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "run"), "--options-file",
           tiny_model_files[0], "--weight-file", tiny_model_files[1], "--torch-threads", "1", "--progress", "off"]
    r = subprocess.run([sys.executable, "-c", code, *run], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "frozen True", (r.stdout, r.stderr)
    assert os.path.exists(tmp_path / "run" / "_SUCCESS")


@pytest.mark.slow
def test_a_command_process_ends_as_the_interpreter_would_without_its_teardown(tmp_path):
    """cli.exit_with skips the interpreter's teardown of every module (about 0.2 s once torch is imported) but keeps
    what a command's exit owes: a non-daemon thread still working is joined, a pool's idle workers are released, the
    atexit handlers run (after the threads, as the interpreter orders them), text still buffered in stdout and
    stderr is written, and the status is the process's."""
    done = tmp_path / "thread.txt"
    script = tmp_path / "elmo-pipeline"          # run as the console script is (cli.CONSOLE_SCRIPT)
    code = ("import atexit, sys, threading, time\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "from pipeline.cli import process\n"
            "def work():\n"
            "    time.sleep(0.5)\n"
            f"    open({str(done)!r}, 'w').write('done')\n"
            "def main():\n"
            "    ThreadPoolExecutor(2).submit(print, 'pooled', flush=True).result()   # its workers left idle\n"
            "    threading.Thread(target=work).start()\n"
            f"    atexit.register(lambda: print('atexit', open({str(done)!r}).read()))\n"
            "    sys.stdout.write('buffered, no newline')\n"
            "    sys.stderr.write('to stderr')\n"
            "    return 3\n"
            "process(main)\n")
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}     # the streams buffer, as usual
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stdout == "pooled\nbuffered, no newlineatexit done\n" and r.stderr == "to stderr", (r.stdout, r.stderr)


@pytest.mark.slow
def test_a_host_running_the_command_in_its_own_process_keeps_it_and_a_full_disk_under_stdout_is_the_commands_failure(
        tmp_path):
    """exit_with ends the process itself only where the process is the command's: a host that runs the command's
    module in its own process (runpy in a try, a test runner, cProfile) gets SystemExit and goes on (cProfile writes
    its file, the runner reports its failures),
    `python -i` gets its prompt; and
    where it does end it, the product's last flush failing (a full disk under stdout, the text still buffered) is one
    `error:` line and 75, as docs/scheduling.md says, never 0 with the output lost."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    host = ("import runpy, sys\n"
            "sys.argv = ['elmo-pipeline', 'models']\n"
            "try:\n"
            "    runpy.run_module('elmo_pipeline', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('host caught', e.code)\n"
            "print('host goes on')\n")
    r = subprocess.run([sys.executable, "-c", host], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.splitlines()[-2:] == ["host caught 0", "host goes on"], (r.stdout, r.stderr)
    (tmp_path / "test_host.py").write_text(            # a test runner calling the command's entry in its process
        "import unittest\n"
        "from elmo_pipeline.pipeline.cli import console\n"
        "class T(unittest.TestCase):\n"
        "    def test_a_console(self):\n"
        "        with self.assertRaises(SystemExit):\n"
        "            console(['models'])\n"
        "    def test_b_fails(self):\n"
        "        self.fail('the runner must see this')\n")
    r = subprocess.run([sys.executable, "-m", "unittest", "test_host"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120, env={**env, "PYTHONPATH": REPO})
    assert r.returncode == 1 and "FAILED (failures=1)" in r.stderr, (r.stdout, r.stderr)
    prof = tmp_path / "prof.out"
    r = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "elmo_pipeline", "models"],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 0 and prof.stat().st_size > 0, r.stderr
    r = subprocess.run([sys.executable, "-i", "-m", "elmo_pipeline", "models"], input="print('prompt after it')\n",
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=env)     # python -i: its prompt
    assert r.returncode == 0 and "prompt after it" in r.stdout, (r.stdout, r.stderr)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "elmo_pipeline", "models"], stdout=full, stderr=subprocess.PIPE,
                           text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 75 and r.stderr.strip().splitlines() == [
        "error: [Errno 28] No space left on device (exit 75: retry later)"], r.stderr


@pytest.mark.slow
def test_a_ctrl_c_landing_in_numpys_import_is_never_swallowed(tmp_path, tiny_model_files):
    """torch's extension imports numpy from its C init and drops what that import raised: a Ctrl-C landing there (the
    first second of a command) was lost, and the command ran on to exit 0. The command's process imports numpy before
    torch (pipeline/cli.py), so the interrupt, raised here inside numpy's import, ends it as interrupted."""
    (tmp_path / "in.txt").write_text("The cat sat .\n")
    code = ("import runpy, sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numpy':\n"
            "            sys.meta_path.remove(self)\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv[0] = 'elmo-pipeline'\n"
            "runpy.run_module('elmo_pipeline', run_name='__main__')\n")
    out = tmp_path / "out.hdf5"
    r = subprocess.run([sys.executable, "-c", code, "elmo", str(tmp_path / "in.txt"), str(out), "--all",
                        "--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1]],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode in (-signal.SIGINT, 130) and r.stderr.strip().endswith("KeyboardInterrupt"), (r.returncode,
                                                                                                      r.stderr)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
@pytest.mark.parametrize("sleeps", [500, 0])
def test_an_interrupt_that_lands_in_a_collectors_callback_is_raised_again(sig, status, sleeps):
    """A signal whose handler runs inside a weakref callback (or a __del__) that the collector called: Python prints
    "Exception ignored" and drops the KeyboardInterrupt / Terminated, and the command ran on to exit 0 (seen with
    SIGTERM in the `elmo` command as it wrote). process() sends the signal again, from a thread, so the command ends
    as interrupted; one dropped as the command's work ends (no time left to send it again) is its status."""
    code = ("import os, signal, sys, time, weakref\n"
            "from elmo_pipeline.pipeline.cli import process\n"
            "class Obj:\n"
            "    pass\n"
            "def main():\n"
            "    obj = Obj()\n"
            "    def callback(ref):\n"
            f"        os.kill(os.getpid(), signal.{sig})\n"
            "        for _ in range(1000):\n"
            "            pass\n"
            "    ref = weakref.ref(obj, callback)\n"
            "    del obj\n"
            f"    for _ in range({sleeps}):\n"
            "        time.sleep(0.01)\n"
            "    print('ran on', file=sys.stderr)\n"
            "    return 0\n"
            "process(main)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == status and "Exception ignored" not in r.stderr, (r.returncode, r.stderr)
    assert not sleeps or "ran on" not in r.stderr, r.stderr        # with time left, it ended the work
    lines = r.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], r.stderr


@pytest.mark.slow
def test_run_prints_only_its_summary(tmp_path, tiny_model_files):
    """No Beam notices (apitools, BigQuery, type hints) on stderr: the summary line is all a run prints."""
    corpus = tmp_path / "in.txt"
    corpus.write_text("A sentence. And another one.\n")
    for entry in (["-m", "elmo_pipeline.pipeline.run"], ["-m", "elmo_pipeline.pipeline.cli", "run"]):
        out = tmp_path / entry[-1]
        r = subprocess.run([sys.executable, *entry, "--input", str(corpus), "--output", str(out), "--options-file",
                            tiny_model_files[0], "--weight-file", tiny_model_files[1], "--torch-threads", "1"],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0 and (out / "_SUCCESS").exists(), r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elmo-pipeline: 1 documents, 2 sentences"), lines


def test_quiet_beam_drops_only_beams_import_notice():
    import apache_beam

    from elmo_pipeline.pipeline.quiet import quiet_beam
    quiet_beam()
    root = logging.getLogger()
    beam_file = os.path.join(os.path.dirname(apache_beam.__file__), "io", "gcp", "internal", "clients", "bigquery",
                             "__init__.py")
    notice = "apitools not found, and bigquery client libraries are not available despite the import not raising"

    def shown(path, level, msg):
        return bool(root.filter(logging.LogRecord("root", level, path, 1, msg, None, None)))

    assert not shown(beam_file, logging.WARNING, notice)
    assert shown(beam_file, logging.ERROR, notice)                   # errors always pass
    assert shown(beam_file, logging.WARNING, "something else went wrong")
    assert shown(__file__, logging.WARNING, notice)                  # the same words from elsewhere
    assert logging.getLogger("apache_beam").getEffectiveLevel() == logging.WARNING
