"""An HTTP store that refuses or fails (a local server on 127.0.0.1, tests/model_server.py): the run ends with one
`error:` line and the documented status, never exit 0 with the file lost, and the URL's secret is nowhere (stderr,
the output, worker processes' logs); `elmo-pipeline elmo` and `models` print no secret either; a bad runner option
and a folder at a name Finalize writes are refused before the output is touched."""
import os
import subprocess
import sys

import pytest

from elmo_pipeline.pipeline.run import main
from tests.model_server import ModelServer
from tests.resume_helpers import REPO, run_subprocess

SECRET = "s3cr3tSig"
TEXT = b"Seagulls argued over the last chip on the pier.\nThe keeper lit the lamp at dusk.\n"


def run_args(tiny_model_files, out, inp, *extra, options=None):
    return ["--input", inp, "--output", str(out), "--options-file", options or tiny_model_files[0],
            "--weight-file", tiny_model_files[1], "--torch-threads", "1", "--progress", "off", *extra]


def everything_under(folder) -> str:
    """The names and bytes of every file under `folder` (none: '')."""
    out = []
    for d, _, files in os.walk(folder):
        for n in files:
            out.append(os.path.join(d, n) + open(os.path.join(d, n), "rb").read().decode("utf-8", "replace"))
    return "".join(out)


@pytest.mark.parametrize("status, exit_status", [(403, 65), (404, 65), (503, 75)])
def test_an_input_url_that_fails_as_it_is_read_fails_the_run_redacted(tiny_model_files, tmp_path, capsys, status,
                                                                        exit_status):
    """HEAD answers as for the file, GET fails (an expired presigned URL, a server failing): before, the file was a
    dead letter quoting the URL with its signature, and the run exited 0."""
    with ModelServer() as server:
        server.files["/in/docs.txt"] = TEXT
        server.get_status["/in/docs.txt"] = status
        out = tmp_path / "out"
        assert main(run_args(tiny_model_files, out, f"{server.url}/in/docs.txt?sig={SECRET}")) == exit_status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"(exit {exit_status}:" in lines[0] and str(status) in lines[0], err
    assert SECRET not in err and SECRET not in everything_under(out)
    assert not os.path.exists(out / "_SUCCESS")


def test_a_failing_server_is_retry_later_when_listing_inputs_or_fetching_the_model(tiny_model_files, tmp_path,
                                                                                    capsys, monkeypatch):
    """fsspec's HTTP store says FileNotFoundError for a 503 too: its cause says retry later (75), not 'matches no
    file' (65); a 404 stays 65."""
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))
    with ModelServer() as server:
        server.files["/in/docs.txt"] = TEXT
        server.files["/m/options.json"] = open(tiny_model_files[0], "rb").read()
        server.status["/in/docs.txt"] = 503
        assert main(run_args(tiny_model_files, tmp_path / "a", f"{server.url}/in/docs.txt?sig={SECRET}")) == 75
        del server.status["/in/docs.txt"]
        server.status["/m/options.json"] = 503
        local = tmp_path / "in.txt"
        local.write_bytes(TEXT)
        assert main(run_args(tiny_model_files, tmp_path / "b", str(local),
                             options=f"{server.url}/m/options.json?sig={SECRET}")) == 75
        assert main(run_args(tiny_model_files, tmp_path / "c", f"{server.url}/in/gone.txt?sig={SECRET}")) == 65
    err = capsys.readouterr().err
    assert [line.rsplit("(exit ", 1)[1] for line in err.splitlines() if line.startswith("error:")] == \
        ["75: retry later)", "75: retry later)", "65: fix the data)"], err
    assert SECRET not in err


def test_an_unreachable_store_is_retry_later_when_listing_inputs_or_fetching_the_model(tiny_model_files, tmp_path,
                                                                                         capsys, monkeypatch):
    """Nothing listening at the port (connection refused), or a host name that does not resolve: fsspec says
    FileNotFoundError; the cause is the store's, so 75 (retry later), not 'matches no file' / 'no such file' (65)."""
    import socket
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))
    with socket.socket() as s:                  # a free port, closed again: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = tmp_path / "in.txt"
    local.write_bytes(TEXT)
    for i, (inp, options) in enumerate([(f"http://127.0.0.1:{port}/in/docs.txt?sig={SECRET}", None),
                                        (str(local), f"http://u:{SECRET}@127.0.0.1:{port}/m/options.json"),
                                        (f"http://no-such-host.invalid/in/docs.txt?sig={SECRET}", None)]):
        assert main(run_args(tiny_model_files, tmp_path / f"o{i}", inp, options=options)) == 75
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 3 and SECRET not in err, err


@pytest.mark.slow
def test_worker_processes_print_no_secret(tiny_model_files, tmp_path):
    """--direct_running_mode multi_processing: the workers' own log lines and what Beam's SDK worker prints on stderr
    are redacted, and the failing bundle's traceback it prints is dropped (transforms/logs.py; before: printed by
    each worker whose bundle failed); the launcher prints one line, the status of the cause (before: 70, from the
    worker's text)."""
    with ModelServer() as server:
        server.files["/in/docs.txt"] = TEXT
        server.get_status["/in/docs.txt"] = 404
        p = run_subprocess(run_args(tiny_model_files, tmp_path / "out", f"{server.url}/in/docs.txt?sig={SECRET}",
                                    "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"))
    assert p.returncode == 65, p.stderr[-3000:]
    assert SECRET not in p.stderr and "sig=***" in p.stderr, p.stderr[-3000:]
    assert len([line for line in p.stderr.splitlines() if line.startswith("error:")]) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
def test_the_elmo_and_models_commands_print_no_secret(tiny_model_files, tmp_path):
    """`elmo-pipeline elmo` with a model file or an input at a URL that fails, `models` with a mirror URL holding a
    password: one `error:` line (exit 1) or the listing, the password and signature masked."""
    with ModelServer() as server:
        server.files["/in.txt"] = TEXT
        server.get_status["/gone.txt"] = 404
        url = server.url.replace("http://", f"http://alice:{SECRET}@")
        runs = [["elmo", str(tmp_path / "x.txt"), str(tmp_path / "a.hdf5"), "--all", "--options-file",
                 f"{url}/m/gone.json?sig={SECRET}", "--weight-file", tiny_model_files[1]],
                ["elmo", f"{url}/gone.txt?sig={SECRET}", str(tmp_path / "b.hdf5"), "--all", "--options-file",
                 tiny_model_files[0], "--weight-file", tiny_model_files[1]]]
        (tmp_path / "x.txt").write_bytes(TEXT)
        env = dict(os.environ, ELMO_PIPELINE_CACHE=str(tmp_path / "cache"))
        for args in runs:
            r = subprocess.run([sys.executable, "-m", "elmo_pipeline", *args], capture_output=True, text=True,
                               cwd=REPO, env=env, timeout=300)
            assert r.returncode == 1 and SECRET not in r.stderr + r.stdout, r.stderr
            assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "elmo_pipeline", "models"], capture_output=True, text=True, cwd=REPO,
                       env=dict(env, ELMO_PIPELINE_MODELS_URL=f"https://alice:{SECRET}@mirror.example/elmo"),
                       timeout=300)
    assert r.returncode == 0 and "published models: https://***@mirror.example/elmo" in r.stdout, r.stdout
    assert SECRET not in r.stdout + r.stderr


@pytest.mark.parametrize("name", ["report.html", "_SUCCESS", "manifest.json", "metrics.prom"])
def test_a_folder_at_a_name_finalize_writes_is_refused_before_anything_runs(tiny_model_files, tmp_path, capsys,
                                                                            name):
    """Before: the run embedded everything, then moved its report into the user's folder (report.html/report.html)
    or failed at the end leaving final-named files (_SUCCESS/)."""
    inp = tmp_path / "in.txt"
    inp.write_bytes(TEXT)
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "keep.txt").write_text("mine")
    assert main(run_args(tiny_model_files, out, str(inp), "--overwrite")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and f"{name}/" in err[-1], err
    assert sorted(os.listdir(out)) == [name] and os.listdir(out / name) == ["keep.txt"]


@pytest.mark.parametrize("flag, value, says", [("--runner", "Nope", "--runner Nope: Unexpected pipeline runner"),
                                               ("--direct_num_workers", "-1", "--direct_num_workers must be >= 0")])
def test_a_bad_runner_option_is_refused_before_the_output_is_touched(tiny_model_files, tmp_path, capsys, flag,
                                                                     value, says):
    inp = tmp_path / "in.txt"
    inp.write_bytes(TEXT)
    assert main(run_args(tiny_model_files, tmp_path / "out", str(inp), flag, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {says}"), err
    assert not os.path.exists(tmp_path / "out")


def test_statuses_read_from_types_and_from_a_workers_text():
    """pipeline/exits.py: an HTTP answer's status (4xx 65; 5xx, 408, 429 75), a body cut short (ClientPayloadError)
    75; a --reuse source's error in a worker's text stays 2 although it mentions a FileNotFoundError."""
    from elmo_pipeline.pipeline.exits import classify

    class ClientResponseError(Exception):
        def __init__(self, status):
            super().__init__(f"{status}, message='x', url='http://h/f?sig={SECRET}'")
            self.status = status

    class ClientPayloadError(Exception):
        pass
    for status, want in ((403, 65), (404, 65), (408, 75), (429, 75), (503, 75)):
        got = classify(ClientResponseError(status))
        assert got.status == want and SECRET not in got.message, (status, got)
    assert classify(ClientPayloadError("Response payload is not completed")).status == 75
    worker = RuntimeError("Traceback (most recent call last):\n...\nFileNotFoundError: [Errno 2] gone\n\nDuring handling"
                          "...\nelmo_pipeline.transforms.reuse.ReuseError: --reuse out/day1: its shard is gone")
    assert classify(worker).status == 2


def test_the_stderr_of_a_worker_is_redacted_whatever_writes_to_it(monkeypatch):
    """transforms/logs.py: write and writelines redacted; a closed stderr (None) left as it is."""
    import io

    from elmo_pipeline.transforms import logs
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    logs.worker_logs()
    logs.worker_logs()                                  # idempotent: wrapped once
    sys.stderr.write(f"http://alice:{SECRET}@h/f\n")
    sys.stderr.writelines([f"x?sig={SECRET}\n"])
    assert SECRET not in buf.getvalue() and buf.getvalue().count("***") == 2
    buf.seek(0)
    buf.truncate(0)
    beam = {"sys": sys}                                 # Beam's SDK worker printing a failed instruction's traceback
    exec(compile("def _execute():\n    print('Traceback (most recent call last):\\n  ...\\nValueError: x', "
                 "file=sys.stderr)\n", "/v/site-packages/apache_beam/runners/worker/sdk_worker.py", "exec"), beam)
    beam["_execute"]()
    print("Traceback (most recent call last): printed by anything else", file=sys.stderr)
    assert buf.getvalue() == "Traceback (most recent call last): printed by anything else\n", buf.getvalue()
    monkeypatch.setattr(sys, "stderr", None)
    logs.worker_logs()
    assert sys.stderr is None


def test_an_unlisted_doc_hashes_file_is_left_alone_with_overwrite(tiny_model_files, tmp_path, capsys):
    """An earlier upsert's state file at the top (an Iceberg snapshot still names it; --overwrite leaves it) does not
    block the folder: only a folder at that name is in the way."""
    inp = tmp_path / "in.txt"
    inp.write_bytes(TEXT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "doc_hashes.parquet").write_bytes(b"an earlier day's state")
    assert main(run_args(tiny_model_files, out, str(inp), "--overwrite")) == 0
    assert (out / "doc_hashes.parquet").read_bytes() == b"an earlier day's state"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "doc_hashes.parquet").mkdir()
    assert main(run_args(tiny_model_files, tmp_path / "other", str(inp), "--overwrite")) == 2
