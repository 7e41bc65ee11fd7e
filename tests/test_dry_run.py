"""--dry-run / `elmo-pipeline plan`: estimates from a sample within 10 % of the real run (documents, tokens,
output bytes per format), on WikiText-2 text read through a sample much smaller than the input; exit 0; not one
byte under --output (not created when absent, unchanged when finished)."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from elmo_pipeline.pipeline.dry_run import estimate
from elmo_pipeline.pipeline.run import main
from tests.conftest import shared_path
from tests.resume_helpers import REPO, argv

LINES = 1500           # of WikiText-2 valid: ~400 KB, ~80,000 tokens


def folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def snapshot(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): (hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest(),
                                                          os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    src = shared_path("data", "wikitext-2", "valid.txt")
    path = tmp_path_factory.mktemp("wt") / "valid-head.txt"
    with open(src, "rb") as f:
        path.write_bytes(b"".join(f.readline() for _ in range(LINES)))
    return str(path)


@pytest.mark.slow
def test_estimates_within_10_percent_of_the_run(wikitext, tiny_model_files, tmp_path):
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, wikitext, out, "--shard-sentences", "2000")
    size = os.path.getsize(wikitext)
    plan = estimate(args, sample_bytes=size // 5)           # a fifth of the input, in slices spread over it
    assert not os.path.exists(out)
    assert main(args) == 0
    m = json.load(open(os.path.join(out, "manifest.json")))
    real = {"documents": m["counts"]["documents"], "tokens_written": m["counts"]["tokens_written"],
            "sentences": m["counts"]["sentences"], "input_records": m["counts"]["input_records"]}
    assert 0 < plan["sample"]["tokens_written"] < 0.5 * real["tokens_written"]    # a sample, scaled up
    for k, v in real.items():
        assert abs(plan["estimated"][k] - v) <= 0.1 * v, (k, plan["estimated"][k], v)
    for fmt in ("parquet", "hdf5"):
        got = folder_bytes(os.path.join(out, fmt))
        assert abs(plan["output_bytes"][fmt] - got) <= 0.1 * got, (fmt, plan["output_bytes"][fmt], got)
    assert plan["rate"]["tokens_per_s"] > 0 and plan["seconds"]["embed"] > 0
    print({k: (plan["estimated"][k], v) for k, v in real.items()}, plan["output_bytes"])


@pytest.mark.slow
def test_arrow_output_estimated(wikitext, tiny_model_files, tmp_path):
    """--format arrow has its bytes and its layers in the plan (it had none: 'output (arrow; ...): ; at least 1
    shard(s)' and an empty table of layers), within 10 % of the run's."""
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, wikitext, out, "--shard-sentences", "2000", "--format", "arrow")
    plan = estimate(args, sample_bytes=os.path.getsize(wikitext) // 5)
    assert [r["layer"] for r in plan["layer_bytes"] if r["format"] == "arrow"] == plan["layers"]
    assert main(args) == 0
    got = folder_bytes(os.path.join(out, "arrow"))
    assert abs(plan["output_bytes"].get("arrow", 0) - got) <= 0.1 * got, (plan["output_bytes"], got)


@pytest.mark.slow
def test_plan_exits_0_and_touches_no_output(wikitext, tiny_model_files, tmp_path):
    out = tmp_path / "out"
    args = argv(tiny_model_files, wikitext, str(out))
    cmd = [sys.executable, "-m", "elmo_pipeline.pipeline.cli", "plan", *args]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "nothing was written" in p.stdout and "tokens written" in p.stdout and "tokens/s" in p.stdout
    assert not out.exists()
    assert main(args) == 0
    before = snapshot(out)
    again = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", "--dry-run", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and "holds the finished run of this same command" in again.stdout, again.stderr
    assert snapshot(out) == before


def _error_line(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_plan_refuses_what_the_run_refuses_in_its_words_and_writes_nothing(tiny_model_files, tmp_path, capsys):
    """An output the run refuses (exit 2) is refused by the plan, with the run's status and `error:` line: a folder
    that holds no run, a foreign file where the output goes (even with --overwrite), a finished run of another
    command, a symbolic link in _staging/; a damaged lease object written just now, which the run dates by the
    object's own age (75), the plan says so. The plan writes nothing in any of them."""
    from tests.resume_helpers import write_corpus
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=3, seed=5)
    (tmp_path / "notempty").mkdir()
    (tmp_path / "notempty" / "notes.txt").write_text("hi")
    (tmp_path / "foreign" / "parquet").mkdir(parents=True)
    (tmp_path / "foreign" / "parquet" / "x.parquet").write_text("hi")
    assert main(argv(tiny_model_files, corpus, str(tmp_path / "other"))) == 0
    (tmp_path / "link" / "_staging").mkdir(parents=True)
    os.symlink(str(tmp_path / "notempty"), str(tmp_path / "link" / "_staging" / "abc"))
    (tmp_path / "lease").mkdir()
    (tmp_path / "lease" / "_lease.json").write_text('{"token": "x", "heartbeat": 1e300, "pid": 1}')
    capsys.readouterr()
    for name, extra, status in (("notempty", [], 2), ("foreign", ["--overwrite"], 2), ("other", ["--layers", "2"], 2),
                                ("link", [], 2), ("lease", [], 75)):
        args = argv(tiny_model_files, corpus, str(tmp_path / name), *extra)
        before = snapshot(tmp_path / name)
        planned = main(["--dry-run", *args])
        plan_out = capsys.readouterr()
        assert snapshot(tmp_path / name) == before, name
        ran = main(args)
        run_err = _error_line(capsys.readouterr().err)
        assert ran == status, (name, run_err)
        if status == 75:         # a moment's state, not the command's: the plan says it and exits 0
            assert planned == 0 and "`run` would exit 75" in plan_out.out and "is held by a live run" in plan_out.out
        else:
            assert (planned, _error_line(plan_out.err)) == (ran, run_err), name


def test_plan_lines_name_files_on_one_line_each(tiny_model_files, tmp_path):
    """An input named with a newline and an --output with a terminal escape: the plan's lines name them escaped,
    one line each (a file 'a\\nestimated (sample scaled by bytes): 0 records.txt' printed a forged estimate line)."""
    from elmo_pipeline.pipeline.dry_run import dry_run
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a\nestimated (sample scaled by bytes): 0 records.txt").write_text("A line here.\n")
    text = dry_run(argv(tiny_model_files, str(tmp_path / "in" / "*.txt"), str(tmp_path / "out\x1b[2J")))
    assert [line for line in text.splitlines() if line.startswith("estimated")] == \
        ["estimated (sample scaled by bytes): 1 records, 1 documents, 1 sentences, 4 tokens written, 0 dead letters"]
    assert "\x1b" not in text and "out\\x1b[2J" in text.splitlines()[0] and "a\\nestimated" in text
