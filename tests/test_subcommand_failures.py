"""The subcommands besides run/plan (elmo, probe, evaluate, export, train, models, doctor) end a failure with one
`error:` line (exit 1; the traceback too with --verbose: pipeline/cli.py), and read what they are given with
bounds: a label file that is no regular file or holds no JSON objects, a checkpoint whose datasets are not the
model's (never allocated)."""
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from elmo_pipeline.pipeline.cli import main
from tests.resume_helpers import REPO


def test_an_unexpected_failure_is_one_line_and_its_traceback_only_with_verbose(tmp_path, capsys):
    text = tmp_path / "held-out.txt"
    text.write_text("the cat sat\n")
    bad = tmp_path / "ckpt.h5"
    bad.write_bytes(b"not hdf5 at all")
    assert main(["evaluate", str(text), "--checkpoint", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    assert main(["evaluate", str(text), "--checkpoint", str(bad), "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_checkpoint_datasets_not_the_models_are_refused_before_they_are_read(tmp_path):
    """training/checkpoint.py _tensors: a dataset of another shape or name than the module's state_dict, or over
    the optimizer state's bound, is refused by its declared shape (a 2 GB one is never allocated)."""
    from elmo_pipeline.training.checkpoint import _tensors
    path = str(tmp_path / "c.h5")
    with h5py.File(path, "w") as f:
        f["model/w"] = np.ones((2, 3), np.float32)
        f.create_dataset("model/junk", shape=(500_000_000,), dtype="float32", chunks=(1024,))
        f["opt/0/exp_avg"] = np.ones((2, 3), np.float32)
        f.create_dataset("opt/0/huge", shape=(500_000_000,), dtype="float32", chunks=(1024,))
    with h5py.File(path, "r") as f:
        with pytest.raises(ValueError, match=r"model/junk: a dataset of shape \(500000000,\), not the model's None"):
            _tensors(f["model"], {"w": (2, 3)})
        with pytest.raises(ValueError, match=r"model/w: a dataset of shape \(2, 3\), not the model's \(3, 2\)"):
            _tensors(f["model"], {"w": (3, 2), "junk": (500_000_000,)})
        with pytest.raises(ValueError, match=r"opt/0/huge: .*at most 6 values"):
            _tensors(f["opt"], limit=6)


@pytest.mark.parametrize("content", ["fifo", "5\n", "[" * 100_000 + "\n", "folder"])
def test_a_label_file_that_is_no_file_of_json_objects_is_one_error(tmp_path, content):
    """downstream/labels.py: a FIFO (its open would block), a line that is no object, JSON nested past the
    parser, a folder: ValueError or one error line, never a hang or a traceback."""
    from elmo_pipeline.downstream.labels import load_sentence_labels
    path = tmp_path / "labels.jsonl"
    if content == "fifo":
        os.mkfifo(path)
    elif content == "folder":
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises((ValueError, IsADirectoryError)):
        load_sentence_labels(str(path))


@pytest.mark.slow
def test_probe_with_a_fifo_for_labels_ends_in_one_line(tmp_path):
    labels = tmp_path / "labels.jsonl"
    os.mkfifo(labels)
    r = subprocess.run([sys.executable, "-m", "elmo_pipeline", "probe", "--train", str(tmp_path / "no-output"),
                        "--labels", str(labels), "--out", str(tmp_path / "probe")], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode in (1, 2) and r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["labels.tsv", "tags.conllu"])
def test_a_label_file_line_over_the_limit_is_refused_unread(tmp_path, monkeypatch, name):
    """downstream/labels.py: a line over MAX_LINE_CHARS (here 1,000) is a ValueError naming it, read no further
    than the limit; lines up to it read as before."""
    import elmo_pipeline.downstream.labels as labels
    monkeypatch.setattr(labels, "MAX_LINE_CHARS", 1000)
    path = tmp_path / name
    path.write_text("# a\tpos\n" + "b\t" + "x" * 1200 + "\n")
    read = labels.read_conllu if name.endswith(".conllu") else labels.load_sentence_labels
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: a line over 1000 characters")):
        read(str(path))
    path.write_text("# a\tpos\n" + "b\t" + "x" * 998 + "\r\n")          # exactly the limit, CRLF
    assert labels.load_sentence_labels(str(path))["b"] == "x" * 998
