"""A bad command line fails before any work: exit 2 (65 for an input matching no file: the data is missing), one line
"error: ..." naming the problem, no output folder."""
import json
import os

import pytest

from elmo_pipeline.pipeline.run import main


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("A sentence.\n")
    return str(p)


def _fails(capsys, argv, out, message, status=2):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == status, err
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not os.path.exists(out), f"{out} was created"
    return err[0]


@pytest.mark.parametrize("flags,message", [
    (["--layers", "5"], "--layers '5': indices must be distinct and in 0..2"),
    (["--layers", "middle"], "--layers must be all, top, average or indices"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--format", "csv"], "--format takes a comma-separated list of parquet, hdf5, arrow"),
    (["--max-tokens-per-batch", "0"], "--max-tokens-per-batch must be >= 1, got 0"),
    (["--max-sentence-tokens", "-5"], "--max-sentence-tokens must be >= 1, got -5"),
    (["--shard-bytes", "0"], "--shard-bytes must be >= 1"),
    (["--window-tokens", "100", "--window-overlap", "100"], "--window-overlap 100 must be smaller than --window-tokens 100"),
    (["--window-overlap", "-1"], "--window-overlap must be >= 0"),
    (["--torch-threads", "-2"], "--torch-threads must be >= 0"),
    (["--torch-threads", "100000"], "--torch-threads must be at most 1024 (threads), got 100000"),
    (["--embed-threads", "1025"], "--embed-threads must be at most 1024 (threads), got 1025"),
    (["--direct_num_workers", "5000"], "--direct_num_workers must be at most 1024 (worker processes), got 5000"),
    (["--lease-stale-seconds", "inf"], "--lease-stale-seconds must be a finite number, got inf"),
    (["--lease-stale-seconds", "nan"], "--lease-stale-seconds must be a finite number, got nan"),
    (["--lease-stale-seconds", "1e11"], "--lease-stale-seconds must be at most 604800 (a week), got 100000000000.0"),
    (["--lease-stale-seconds", "0.5"], "--lease-stale-seconds must be >= 1, got 0.5"),
    (["--s3-max-attempts", "-5"], "--s3-max-attempts must be >= 1, got -5"),
    (["--s3-max-attempts", "0"], "--s3-max-attempts must be >= 1, got 0"),
    (["--max-sentence-token", "5"], "unknown flag(s): --max-sentence-token"),
    (["--model", "no-such-model"], "no model named 'no-such-model'"),
    (["--state", "stateful", "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"],
     "--state stateful keeps input order"),
    # user info in the endpoint: S3 clients refuse it at the first request (was exit 70 after planning)
    (["--s3_endpoint_url", "http://admin:s3cr3t@127.0.0.1:9"],
     "--s3_endpoint_url http://***@127.0.0.1:9: credentials in the URL are not used by S3 clients"),
])
def test_bad_flags(capsys, tmp_path, corpus, tiny_model_files, flags, message):
    out = str(tmp_path / "out")
    model = [] if "--model" in flags else ["--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1]]
    _fails(capsys, ["--input", corpus, "--output", out, *model, *flags], out, message)


def test_input_matching_no_file(capsys, tmp_path, tiny_model_files):
    out = str(tmp_path / "out")
    _fails(capsys, ["--input", str(tmp_path / "nothing*.txt"), "--output", out, "--options-file", tiny_model_files[0],
                    "--weight-file", tiny_model_files[1]], out, "matches no file", status=65)


@pytest.mark.parametrize("odd", ["fifo", "link to nothing"])
def test_a_glob_matching_a_file_that_is_no_regular_file_is_refused_naming_it(capsys, tmp_path, tiny_model_files, odd):
    """fsio/fs.py expand: a FIFO or a symbolic link to nothing (an unmounted volume) a glob matches was dropped
    without a word; now 65 naming it. A folder the glob matches is still passed over, a link to a file read."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("A cat sat.\n")
    (tmp_path / "in" / "dir.txt").mkdir()
    odd_path = tmp_path / "in" / "b.txt"
    if odd == "fifo":
        os.mkfifo(odd_path)
    else:
        odd_path.symlink_to(tmp_path / "unmounted" / "b.txt")
    out = str(tmp_path / "out")
    model = ["--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1]]
    _fails(capsys, ["--input", str(tmp_path / "in" / "*.txt"), "--output", out, *model], out,
           f"matches {odd_path}, which is no regular file", status=65)
    odd_path.unlink()
    odd_path.symlink_to(tmp_path / "in" / "a.txt")
    (tmp_path / "in" / ".#a.txt").symlink_to("user@host.1234:1700000000")       # an editor's lock: passed over
    assert main(["--input", str(tmp_path / "in" / "*.txt"), "--output", out, *model, "--progress", "off"]) == 0
    (tmp_path / "in" / ".c.txt").symlink_to(tmp_path / "unmounted" / "c.txt")     # hidden data is data
    capsys.readouterr()
    _fails(capsys, ["--input", str(tmp_path / "in" / "*.txt"), "--output", str(tmp_path / "out2"), *model],
           str(tmp_path / "out2"), "matches " + str(tmp_path / "in" / ".c.txt") + ", which is no regular file", status=65)


def test_unwritable_output(capsys, tmp_path, corpus, tiny_model_files):
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "out")
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", tiny_model_files[0],
                    "--weight-file", tiny_model_files[1]], out, "is a file, so the folder cannot be created")


@pytest.mark.parametrize("below", [False, True])
def test_output_at_or_under_a_link_to_nothing(capsys, tmp_path, corpus, tiny_model_files, below):
    """A symbolic link to nothing at --output (or above it) is refused naming it, nothing created (not "[Errno 17]
    File exists" from the lease's folder)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    out = str(link / "out" if below else link)
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", tiny_model_files[0],
                    "--weight-file", tiny_model_files[1]], str(tmp_path / "nowhere"),
           f"{link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist")
    assert os.path.islink(link)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only folder")
def test_read_only_output_parent(capsys, tmp_path, corpus, tiny_model_files):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    out = str(ro / "out")
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", tiny_model_files[0],
                    "--weight-file", tiny_model_files[1]], out, "is not writable")


def test_bad_model_files(capsys, tmp_path, corpus, tiny_model_files):
    """The data is bad, not the command: 65 (pipeline/exits.py)."""
    options, weights = tiny_model_files
    out = str(tmp_path / "out")
    (tmp_path / "trunc.hdf5").write_bytes(open(weights, "rb").read()[:1000])
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", options, "--weight-file",
                    str(tmp_path / "trunc.hdf5")], out, "not a valid HDF5 file (truncated or corrupted?)", status=65)
    (tmp_path / "o.json").write_text("{not json")
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", str(tmp_path / "o.json"), "--weight-file",
                    weights], out, "not valid JSON", status=65)
    raw = json.load(open(options))
    raw["lstm"]["projection_dim"] = 9
    (tmp_path / "o2.json").write_text(json.dumps(raw))
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", str(tmp_path / "o2.json"), "--weight-file",
                    weights], out, "expected", status=65)
    _fails(capsys, ["--input", corpus, "--output", out, "--options-file", options, "--weight-file",
                    str(tmp_path / "missing.hdf5")], out, "missing.hdf5", status=65)


def test_console_command_run_exits_2(capsys, tmp_path, corpus):
    from elmo_pipeline.pipeline.cli import main as cli_main
    out = str(tmp_path / "out")
    assert cli_main(["run", "--input", corpus, "--output", out, "--dtype", "float64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: argument --dtype: invalid choice") and not os.path.exists(out)
