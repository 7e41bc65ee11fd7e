"""The subcommands besides run/plan (elmo, probe, evaluate, export, train, models, doctor) end a failure with one
`error:` line (exit 1; the traceback too with --verbose: pipeline/cli.py), and read what they are given with
bounds: a label file that is no regular file or holds no JSON objects, a checkpoint whose datasets are not the
model's (never allocated)."""
import os
import re
import shutil
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
    """training/checkpoint.py read_tensors: a dataset of another shape or name than the module's state_dict, or over
    the optimizer state's bound, is refused by its declared shape (a 2 GB one is never allocated)."""
    from elmo_pipeline.training.checkpoint import read_tensors
    path = str(tmp_path / "c.h5")
    with h5py.File(path, "w") as f:
        f["model/w"] = np.ones((2, 3), np.float32)
        f.create_dataset("model/junk", shape=(500_000_000,), dtype="float32", chunks=(1024,))
        f["opt/0/exp_avg"] = np.ones((2, 3), np.float32)
        f.create_dataset("opt/0/huge", shape=(500_000_000,), dtype="float32", chunks=(1024,))
    with h5py.File(path, "r") as f:
        with pytest.raises(ValueError, match=r"model/junk: a dataset of shape \(500000000,\), not the model's None"):
            read_tensors(f["model"], {"w": (2, 3)})
        with pytest.raises(ValueError, match=r"model/w: a dataset of shape \(2, 3\), not the model's \(3, 2\)"):
            read_tensors(f["model"], {"w": (3, 2), "junk": (500_000_000,)})
        with pytest.raises(ValueError, match=r"opt/0/huge: .*at most 6 values"):
            read_tensors(f["opt"], limit=6)


def test_a_checkpoints_generator_state_and_an_exports_softmax_are_read_only_at_their_shapes(tmp_path, tiny_export):
    """A checkpoint whose rng/torch, or an export whose softmax/... dataset, declares billions of values in a small
    file: refused (the checkpoint) or not loaded (the softmax: an export without one) by the declared shape, never
    allocated (before: read whole, 3.4 GB for a 15 MB file)."""
    import torch
    from elmo_pipeline.training.checkpoint import load_checkpoint, save_checkpoint
    from elmo_pipeline.training.export import export_model, load_softmax
    head, vocab = tiny_export
    opt = torch.optim.Adam(head.parameters())
    path = str(tmp_path / "c.h5")
    save_checkpoint(path, head.bilm, head.softmax, opt, {"step": 1})
    with h5py.File(path, "a") as f:
        del f["rng/torch"]
        f.create_dataset("rng/torch", shape=(3 << 30,), dtype="uint8", chunks=(1 << 20,))
    with pytest.raises(ValueError, match=r"rng/torch: a dataset of shape \(3221225472,\)"):
        load_checkpoint(path, head.bilm, head.softmax, opt)
    export_model(head, vocab, str(tmp_path / "exp"))
    weights = str(tmp_path / "exp" / "weights.hdf5")
    assert load_softmax(head, weights)
    with h5py.File(weights, "a") as f:
        name = next(n for n in f["softmax"])
        shape = f["softmax"][name].shape
        del f["softmax"][name]
        f["softmax"].create_dataset(name, shape=(800_000_000, *shape[1:]), dtype="float32", chunks=True)
    assert not load_softmax(head, weights)


@pytest.mark.parametrize("link", ["external", "soft"])
def test_an_exports_softmax_that_is_a_link_is_refused_never_followed(tmp_path, tiny_export, link):
    """An export's weights.hdf5 whose 'softmax' is an external link (to a FIFO: evaluate and train --init-from hung
    for good; to another file: its softmax loaded as this one's) or a soft link: one WeightsError naming it."""
    import shutil
    from elmo_pipeline.model.weights import WeightsError
    from elmo_pipeline.training.export import export_model, load_softmax
    head, vocab = tiny_export
    export_model(head, vocab, str(tmp_path / "exp"))
    weights = str(tmp_path / "exp" / "weights.hdf5")
    other = str(tmp_path / "other.hdf5")
    shutil.copy(weights, other)
    with h5py.File(weights, "a") as f:
        if link == "external":
            del f["softmax"]
            f["softmax"] = h5py.ExternalLink(other, "/softmax")
        else:
            f.move("softmax", "kept")
            f["softmax"] = h5py.SoftLink("/kept")
    with pytest.raises(WeightsError, match=r"weights\.hdf5: 'softmax' is a link, not a group of the file"):
        load_softmax(head, weights)


def test_a_training_text_line_over_the_limit_is_one_error_naming_it(tmp_path, monkeypatch):
    """training/data.py read_lines: a line longer than MAX_LINE_CHARS (a small .gz can hold gigabytes without a
    newline) is a ValueError naming the file and line, read no further than the limit (before: read whole)."""
    import gzip
    from elmo_pipeline.training import data
    monkeypatch.setattr(data, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "big.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("the cat sat .\n" + "x " * 600 + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: a line over 1000 characters")):
        list(data.read_lines(str(path)))
    assert next(data.read_lines(str(path))) == ["the", "cat", "sat", "."]


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


@pytest.fixture
def tiny_export(tmp_path):
    """(head, vocab) of a tiny trained-shape biLM with its softmax, and a user's file beside."""
    from elmo_pipeline.model.vocab import Vocabulary
    from elmo_pipeline.training.head import build_model
    from tests.test_train import tiny_options
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "the", "cat", "sat", "."])
    return build_model(tiny_options(), vocab), vocab


def _users_file(tmp_path):
    user = tmp_path / "user.txt"
    user.write_bytes(b"the user's own data\n")
    return user


@pytest.mark.parametrize("name", ["weights.hdf5", "options.json", "vocab.txt"])
@pytest.mark.parametrize("kind", ["link to a user's file", "fifo"])
def test_export_never_writes_through_a_link_nor_into_a_fifo(tmp_path, tiny_export, name, kind):
    """training/export.py: a link at one of the exported names (it was written through, into the user's file, or
    replaced) or a FIFO (its open blocked the command) is a FileExistsError naming it before any file is written;
    nothing at the other names, the link and the user's file as they were."""
    from elmo_pipeline.training.export import export_model
    from tests.test_model_resolve import _fifo_with_a_writer
    user, folder = _users_file(tmp_path), tmp_path / "exp"
    folder.mkdir()
    if kind == "fifo":
        _fifo_with_a_writer(str(folder / name))
    else:
        (folder / name).symlink_to(user)
    with pytest.raises(FileExistsError, match=re.escape(str(folder / name)) + " is "):
        export_model(*tiny_export, str(folder))
    assert sorted(p.name for p in folder.iterdir()) == [name] and user.read_bytes() == b"the user's own data\n"
    assert (folder / name).is_symlink() == (kind != "fifo")


def test_export_writes_each_file_whole_with_its_softmax_and_again_over_its_own(tmp_path, tiny_export):
    """The softmax is written in weights.hdf5's one write (no second, in-place append a kill could cut), and a second
    export over the first replaces its files."""
    from elmo_pipeline.training.export import export_model, load_exported
    folder = tmp_path / "exp"
    for _ in range(2):
        export_model(*tiny_export, str(folder))
        head, vocab, loaded = load_exported(str(folder))
        assert loaded and vocab.tokens == tiny_export[1].tokens
    assert sorted(p.name for p in folder.iterdir()) == [".elmo-export", "options.json", "sha256sums.txt", "vocab.txt",
                                                        "weights.hdf5"]


@pytest.mark.parametrize("name", ["options.json", "weights.hdf5", "vocab.txt", "sha256sums.txt", ".elmo-export"])
def test_export_never_replaces_a_users_file(tmp_path, tiny_export, name):
    """export into a folder holding a user's file of an exported name (a regular file, in a folder without an
    export's .elmo-export record): refused before anything is written, every file as it was (before: replaced,
    exit 0); so is a user's folder whose own sha256sums.txt (as `sha256sum` writes it) lists their files."""
    import hashlib
    from elmo_pipeline.training.export import export_model
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / name).write_bytes(b"the user's own data\n")
    with pytest.raises(FileExistsError, match=re.escape(f"{folder / name} exists and is not a file an export wrote")):
        export_model(*tiny_export, str(folder))
    assert [p.name for p in folder.iterdir()] == [name] and (folder / name).read_bytes() == b"the user's own data\n"
    if name == "options.json":
        (folder / "vocab.txt").write_bytes(b"my\nvocab\n")
        (folder / "sha256sums.txt").write_text("".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n"
                                                       for n in ("options.json", "vocab.txt")))
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(FileExistsError, match="exists and is not a file an export wrote"):
            export_model(*tiny_export, str(folder))
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_interrupted_or_changed_export_is_refused_and_a_rerun_finishes_it(tmp_path, tiny_export, monkeypatch):
    """An export killed once its weights are written (before: options.json and vocab.txt of the earlier export
    beside the new weights, loaded as a whole model, exit 0): every load refuses the folder; the same export again
    finishes it. A file changed since (a vocab.txt reordered at its size) is refused by its recorded SHA-256."""
    from elmo_pipeline.model import vocab as vocab_module
    from elmo_pipeline.training import export
    folder = tmp_path / "exp"
    export.export_model(*tiny_export, str(folder))

    def killed(self, path):
        raise KeyboardInterrupt("killed after the weights")
    monkeypatch.setattr(vocab_module.Vocabulary, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        export.export_model(*tiny_export, str(folder))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="an export that did not finish"):
        export.load_exported(str(folder))
    export.export_model(*tiny_export, str(folder))
    assert export.load_exported(str(folder))[2]
    lines = (folder / "vocab.txt").read_bytes().splitlines(keepends=True)
    (folder / "vocab.txt").write_bytes(b"".join(lines[:3] + lines[3:][::-1]))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        export.load_exported(str(folder))


@pytest.mark.parametrize("kind", ["link to a user's file", "fifo", "folder"])
def test_evaluate_json_is_never_written_through_a_link_nor_into_a_fifo(tmp_path, tiny_export, kind):
    """`evaluate --json F`: a link (written through into the user's file), a FIFO (the command blocked after its
    work) or a folder at F is one `error:` line before the model is evaluated, and is left as it is."""
    from elmo_pipeline.training.export import export_model
    from tests.test_model_resolve import _fifo_with_a_writer
    export_model(*tiny_export, str(tmp_path / "model"))
    (tmp_path / "valid.txt").write_text("the cat sat .\n")
    user, out = _users_file(tmp_path), tmp_path / "ppl.json"
    if kind == "fifo":
        _fifo_with_a_writer(str(out))
    elif kind == "folder":
        out.mkdir()
    else:
        out.symlink_to(user)
    assert main(["evaluate", str(tmp_path / "valid.txt"), "--model", str(tmp_path / "model"), "--json",
                 str(out)]) == 1
    assert user.read_bytes() == b"the user's own data\n" and os.path.lexists(out)


def _rows():
    from elmo_pipeline.downstream.report import summarize
    return summarize([{"setting": "layer0", "classifier": "mlp", "seconds": 1.0, "best_epoch": 1,
                       "dev": {"accuracy": 0.5, "macro_f1": 0.4}}])


@pytest.mark.parametrize("name", ["table.md", "results.json", "chart.png"])
def test_probe_report_never_writes_through_a_link(tmp_path, name):
    """downstream/report.py write_report (probe --out): a link at one of its names is refused (it was written through
    into the user's file), the user's file as it was; a fresh report is whole, the chart a PNG."""
    from elmo_pipeline.downstream.report import write_report
    user, out = _users_file(tmp_path), tmp_path / "probe"
    out.mkdir()
    (out / name).symlink_to(user)
    with pytest.raises(FileExistsError, match=re.escape(str(out / name)) + " is a symbolic link"):
        write_report(str(out), _rows(), [], {"task": "sentence"}, None)
    assert user.read_bytes() == b"the user's own data\n" and (out / name).is_symlink()
    (out / name).unlink()
    write_report(str(out), _rows(), [], {"task": "sentence"}, None)
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["chart.png", "results.json", "table.md"]


def _png() -> bytes:
    """A user's own small PNG."""
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["table.md", "results.json", "chart.png"])
def test_probe_report_never_replaces_a_users_file(tmp_path, name):
    """probe --out naming a folder that holds a user's table.md, results.json or chart.png (a regular file the probe
    did not write): refused before the probe trains (check_report_folder) and by write_report, every file as it
    was (before: replaced, exit 0); the probe's own report there is replaced by a rerun."""
    from elmo_pipeline.downstream.report import check_report_folder, write_report
    out = tmp_path / "probe"
    write_report(str(out), _rows(), [], {"task": "sentence"}, None)
    check_report_folder(str(out))
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    write_report(str(out), _rows(), [], {"task": "sentence"}, None)          # its own files: replaced
    assert sorted(p.name for p in out.iterdir()) == sorted(first)
    users = {"table.md": b"| my | notes |\n", "results.json": b'{"mine": 1}\n',
             "chart.png": _png()}[name]
    (out / name).write_bytes(users)
    for call in (lambda: check_report_folder(str(out)),
                 lambda: write_report(str(out), _rows(), [], {"task": "sentence"}, None)):
        with pytest.raises(FileExistsError, match=re.escape(f"{out / name} exists and is not a file the probe wrote")):
            call()
    assert (out / name).read_bytes() == users
    assert all((out / n).read_bytes() == first[n] for n in first if n != name)


HOSTILE_READS = {   # what is no regular file -> the command line reading it ({fifo}: a FIFO, {model}: an exported folder)
    "train --options": (["train", "{text}", "--output", "{tmp}/run", "--options", "{fifo}", "--max-steps", "1"]),
    "train's text": (["train", "{fifo}", "--output", "{tmp}/run", "--max-steps", "1"]),
    "evaluate's text": (["evaluate", "{fifo}", "--model", "{model}"]),
    "evaluate --checkpoint": (["evaluate", "{text}", "--checkpoint", "{fifo}"]),
    "export's checkpoint": (["export", "{fifo}", "{tmp}/exp"]),
    "an exported folder's options.json": (["evaluate", "{text}", "--model", "{tmp}/fifo-model"]),
}


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("case", list(HOSTILE_READS))
def test_a_file_read_that_is_no_regular_file_is_one_error_line_unread(tmp_path, tiny_export, case, kind, capsys):
    """train, evaluate and export read options files, text, checkpoints and exported folders only as regular files
    (fsio.regular_file; model.options.read_options_file at most 1 MiB): a FIFO blocked each for good, /dev/zero
    was read into memory without end (json.load, a line of text)."""
    from elmo_pipeline.training.export import export_model
    from tests.test_model_resolve import _fifo_with_a_writer
    export_model(*tiny_export, str(tmp_path / "model"))
    (tmp_path / "text.txt").write_text("the cat sat .\n")
    hostile = str(tmp_path / "fifo-model" / "options.json") if "folder" in case else str(tmp_path / "fifo")
    if "folder" in case:
        shutil.copytree(tmp_path / "model", tmp_path / "fifo-model")
        os.remove(hostile)
    if kind == "fifo":
        _fifo_with_a_writer(hostile)
    elif "folder" in case:
        os.symlink("/dev/zero", hostile)
    else:
        hostile = "/dev/zero"
    argv = [a.format(tmp=tmp_path, text=tmp_path / "text.txt", fifo=hostile, model=tmp_path / "model")
            for a in HOSTILE_READS[case]]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "not a regular file" in err[-1] and "Traceback" not in "".join(err), err


@pytest.mark.parametrize("name", ["curves.csv", "curves.png", "options.json", "vocab.txt"])
def test_train_never_writes_through_a_link_in_its_run_folder(tmp_path, name):
    """training/train.py: a link at one of the run folder's names is never written through into the user's file
    (curves.csv was truncated through it, curves.png drawn over it, options.json and vocab.txt written through):
    refused with a FileExistsError naming it (the drawing only: logged, training goes on)."""
    from elmo_pipeline.training.train import TrainConfig, train
    from tests.test_train import tiny_options
    user, run = _users_file(tmp_path), tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(user)
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)
    cfg = TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(run), progress=False, threads=1,
                      options=tiny_options(), max_steps=1, checkpoint_every=1, log_every=1, export=False)
    with pytest.raises(ValueError, match=re.escape(f"holds a training run's files ({name}): pass --resume")):
        train(cfg)                                # a fresh run: the folder must hold no run's files
    cfg.resume = True                             # the folder declared a run's: its names written only when files
    if name == "curves.png":
        train(cfg)
    else:
        with pytest.raises(FileExistsError, match=re.escape(str(run / name)) + " is a symbolic link"):
            train(cfg)
    assert user.read_bytes() == b"the user's own data\n" and (run / name).is_symlink()


def test_a_second_run_into_a_run_folder_is_refused_and_user_checkpoints_are_never_rotated(tmp_path):
    """train without --resume into a folder holding a run: refused, every file as it was (before: the second run's
    checkpoints rotated in among the first's, its options and vocabulary over the first's, exit 0); with --resume, a
    user's ckpt-best.h5 in checkpoints/ is neither rotated away nor taken for the latest."""
    from elmo_pipeline.training.train import TrainConfig, latest_checkpoint, train
    from tests.test_train import tiny_options
    run = tmp_path / "run"
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)

    def cfg(**kw):
        return TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(run), progress=False, threads=1,
                           options=tiny_options(), checkpoint_every=1, log_every=1, export=False, **kw)
    train(cfg(max_steps=2))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="holds a training run's files"):
        train(cfg(max_steps=4))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    (run / "checkpoints" / "ckpt-best.h5").write_bytes(b"the user's own checkpoint\n")
    (run / "checkpoints" / "ckpt-0-mine.h5").write_bytes(b"the user's own checkpoint\n")
    train(cfg(max_steps=6, resume=True, keep_checkpoints=1))
    assert latest_checkpoint(str(run)).endswith("ckpt-00000006.h5")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-0-mine.h5", "ckpt-00000006.h5",
                                                                       "ckpt-best.h5"]


@pytest.mark.parametrize("kind", ["a file at --out", "a link at results.json"])
def test_probe_refuses_an_out_it_could_not_write_before_it_reads_or_trains(tmp_path, capsys, kind):
    """`probe --out` holding a file, or a link at one of the report's names: one `error:` line (exit 2) before any
    split is read or any classifier trained (it was found only after all the training)."""
    user, out = _users_file(tmp_path), tmp_path / "probe"
    if kind == "a file at --out":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "results.json").symlink_to(user)
    assert main(["probe", "--train", str(tmp_path / "no-such-output"), "--labels", str(tmp_path / "none.jsonl"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {out}") and user.read_bytes() == b"the user's own data\n", err


TINY_RUN = ["--n-layers", "1", "--lstm-dim", "32", "--projection-dim", "16", "--batch-size", "4", "--unroll-steps",
            "20", "--vocab-size", "500", "--softmax", "full", "--threads", "1", "--no-progress", "--max-steps", "2",
            "--checkpoint-every", "1"]


def _text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)
    return str(path)


def _one_usage_line(capsys, argv) -> str:
    """`argv` refused as it is parsed: exit 2 and one line `error: ...` (no usage)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: argument "), err
    return err[0]


URL_OUTPUTS = {   # an output these commands write locally only, given as a URL -> (command line, the flag named)
    "train --output s3://": (["train", "{text}", "--output",
                              "s3://AKIAEXAMPLE:wJalrSECRET@bucket/run?X-Amz-Signature=abc123", *TINY_RUN], "--output"),
    "train --output file://": (["train", "{text}", "--output", "file://{tmp}/run", *TINY_RUN], "--output"),
    "export FOLDER https://": (["export", "{tmp}/run", "https://user:hunter2@host/x?token=tok"], "folder"),
    "evaluate --json s3://": (["evaluate", "{text}", "--checkpoint", "{ckpt}", "--json",
                               "s3://AKIAEXAMPLE:wJalrSECRET@bucket/ppl.json?X-Amz-Signature=abc123"], "--json"),
}


@pytest.mark.parametrize("case", list(URL_OUTPUTS))
def test_a_url_for_what_train_export_or_evaluate_writes_is_one_redacted_line_before_anything_is_created(
        tmp_path, monkeypatch, capsys, case):
    """train's --output, export's FOLDER and evaluate --json are local (os.makedirs on a URL made folders named after
    its key and signature, `file:` for file://, then failed): a URL is one `error:` line, redacted, exit 2, before
    anything is written or trained; the run folder an export would read is unchanged."""
    from elmo_pipeline.training.train import TrainConfig, latest_checkpoint, train
    from tests.test_train import tiny_options
    text = _text(tmp_path)
    train(TrainConfig(train_files=[text], out_dir=str(tmp_path / "run"), progress=False, threads=1,
                      options=tiny_options(), max_steps=1, checkpoint_every=1, log_every=1, export=False))
    if "file://" in case:
        shutil.rmtree(tmp_path / "run")
    before = {str(p) for p in tmp_path.rglob("*")}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv, flag = URL_OUTPUTS[case]
    line = _one_usage_line(capsys, [a.format(tmp=tmp_path, text=text, ckpt=latest_checkpoint(str(tmp_path / "run")))
                                    for a in argv])
    assert line.startswith(f"error: argument {flag}: a local ") and "not a URL" in line, line
    assert not re.search(r"AKIA|wJalr|abc123|hunter2|tok\b", line), line
    assert list(cwd.iterdir()) == [] and {str(p) for p in tmp_path.rglob("*")} == before | {str(cwd)}


BELOW_MINIMUM = {   # flag value -> the line's text (a count of 0 divided by zero, a negative one exported an untrained model)
    ("train", "--checkpoint-every", "0"): "must be >= 1, got 0",
    ("train", "--log-every", "0"): "must be >= 1, got 0",
    ("train", "--batch-size", "0"): "must be >= 1, got 0",
    ("train", "--unroll-steps", "0"): "must be >= 1, got 0",
    ("train", "--max-steps", "-5"): "must be >= 1, got -5",
    ("train", "--stop-after", "-1"): "must be >= 1, got -1",
    ("train", "--n-epochs", "0"): "must be >= 1, got 0",
    ("train", "--seed", "-1"): "must be >= 0, got -1",
    ("train", "--checkpoint-minutes", "-1"): "must be > 0, got -1",
    ("train", "--clip-norm", "-1"): "must be >= 0 (0: off), got -1",
    ("train", "--dropout", "inf"): "must be a finite number, got inf",
    ("evaluate", "--batch-size", "0"): "must be >= 1, got 0",
}


@pytest.mark.parametrize("command,flag,value", list(BELOW_MINIMUM))
def test_a_count_below_its_minimum_is_refused_as_the_command_line_is_parsed(tmp_path, tiny_export, capsys,
                                                                             command, flag, value):
    """Zero or negative counts passed the parser and failed after training had started (ZeroDivisionError, range()
    with step 0), or ran to exit 0 (--max-steps -5: an untrained model exported; --stop-after -1): one `error:` line,
    exit 2, before the run folder is created."""
    from elmo_pipeline.training.export import export_model
    text, out = _text(tmp_path), tmp_path / "run"
    if command == "train":
        argv = ["train", text, "--output", str(out), *TINY_RUN, flag, value]
    else:
        export_model(*tiny_export, str(tmp_path / "model"))
        argv = ["evaluate", text, "--model", str(tmp_path / "model"), "--json", str(out), flag, value]
    line = _one_usage_line(capsys, argv)
    assert line == (f"error: argument {flag}: {BELOW_MINIMUM[command, flag, value]} (see `elmo-pipeline {command} "
                    "--help`)") and not out.exists(), line


@pytest.mark.parametrize("content", ["", "  \n\n\t\n"])
def test_evaluate_on_held_out_text_without_tokens_is_an_error_line(tmp_path, tiny_export, capsys, content):
    """An empty or blank held-out file printed `perplexity 1.00 (0 tokens)` and exited 0: one `error:` line naming
    it, exit 1 (as the command's other data errors), nothing printed on stdout, no --json written."""
    from elmo_pipeline.training.export import export_model
    export_model(*tiny_export, str(tmp_path / "model"))
    empty, out = tmp_path / "held-out.txt", tmp_path / "ppl.json"
    empty.write_text(content)
    with pytest.raises(SystemExit) as e:     # its text is the line the interpreter prints, with exit status 1
        main(["evaluate", str(empty), "--model", str(tmp_path / "model"), "--json", str(out)])
    assert e.value.code == f"error: {empty}: no tokens to evaluate (empty or only blank lines)"
    assert capsys.readouterr().out == "" and not out.exists()


def test_an_exports_record_of_another_form_is_one_clear_error(tmp_path, tiny_export):
    """sha256sums.txt as `sha256sum -b` writes it (`HASH *name`) is checked as the text form; a line of no such form,
    or a record emptied (an export's files no longer recorded), is a ValueError naming it (before: a bare unpack or
    file-not-found error, or the folder loaded unchecked)."""
    from elmo_pipeline.training.export import export_model, load_exported
    folder = tmp_path / "exp"
    export_model(*tiny_export, str(folder))
    sums = folder / "sha256sums.txt"
    text = sums.read_text()
    sums.write_text(text.replace("  ", " *"))
    assert load_exported(str(folder))[2]
    for bad, match in ((text.split()[0] + "\n", "line 1 is not '<sha256>  <file name>'"),
                       ("", "does not record each of its files")):
        sums.write_text(bad)
        with pytest.raises(ValueError, match=re.escape(match)):
            load_exported(str(folder))


@pytest.mark.parametrize("out", ["file:///tmp/elmo-probe-report", "memory://proj/report"])
def test_a_probe_report_at_a_url_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, out):
    """probe --out a URL: one `error:` line as the command line is parsed, and write_report refuses it, no folder
    made (before: written into a local folder named 'file:' or 'memory:', the user's report there unchecked)."""
    from elmo_pipeline.downstream.report import write_report
    from elmo_pipeline.pipeline.cli import main
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["probe", "--train", str(tmp_path / "none"), "--labels", str(tmp_path / "l.txt"), "--out", out])
    assert e.value.code == 2 and "not a URL" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="a URL, not a local folder"):
        write_report(out, _rows(), [], {"task": "sentence"}, None)
    assert os.listdir(tmp_path) == []


def test_a_damaged_checkpoint_or_text_is_one_error_naming_it_and_a_killed_writes_temp_is_removed(tmp_path):
    """A checkpoint cut short, one without its meta or with meta of another form, and training text that is not
    UTF-8: a ValueError naming the file (before: h5py's or a KeyError's text, or a codec error, without it); a
    checkpoint's temporary file a killed run left is removed by the next run (before: left for good); a short run
    draws no curves.png warning."""
    import shutil
    from elmo_pipeline.training import train as train_module
    from elmo_pipeline.training.checkpoint import read_meta
    from elmo_pipeline.training.data import read_lines
    from elmo_pipeline.training.train import TrainConfig, latest_checkpoint, train
    from tests.test_train import tiny_options
    run = tmp_path / "run"
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)

    def cfg(**kw):
        kw.setdefault("log_every", 1)
        return TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(run), progress=False, threads=1,
                           options=tiny_options(), checkpoint_every=1, export=False, **kw)
    logged = []
    original = train_module._log
    train_module._log = lambda text: logged.append(text) or original(text)
    try:
        train(cfg(max_steps=2, log_every=1000))           # a checkpoint before any point of curves.csv
    finally:
        train_module._log = original
    assert not [line for line in logged if "could not draw" in line], logged
    ckpt = latest_checkpoint(str(run))
    def meta(path, value):
        with h5py.File(path, "a") as f:
            if value is None:
                del f.attrs["meta"]
            else:
                f.attrs["meta"] = value
    for name in ("cut", "no meta", "other meta"):
        bad = str(tmp_path / f"{name}.h5")
        shutil.copy(ckpt, bad)
        if name == "cut":
            os.truncate(bad, os.path.getsize(bad) // 2)
        else:
            meta(bad, None if name == "no meta" else "[1, 2]")
        with pytest.raises(ValueError, match=re.escape(f"{bad}: not a readable checkpoint")):
            read_meta(bad)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'latin1.txt'}: not UTF-8 text")):
        list(read_lines(str(tmp_path / "latin1.txt")))
    temp = run / "checkpoints" / ("ckpt-00000009.h5.tmp-" + "ab" * 16)
    temp.write_bytes(b"a killed run's half checkpoint")
    train(cfg(max_steps=2, resume=True))
    assert not temp.exists()


def test_train_into_a_folder_a_live_run_holds_is_one_error_line(tmp_path, capsys):
    """A run folder whose lease a live run holds (its _lease.json, the pipeline's lease): `train` (with --resume
    too) is one `error:` line, nothing written (before: both ran, their checkpoints and curves mixed); once the
    holder gives it back, the run trains and gives it back in turn."""
    from elmo_pipeline.output.lease import Lease
    from elmo_pipeline.pipeline.cli import main
    run = tmp_path / "run"
    run.mkdir()
    argv = ["train", _text(tmp_path), "--output", str(run), *TINY_RUN, "--max-steps", "2", "--checkpoint-every", "2"]
    holder = Lease(str(run / "_lease.json")).acquire()
    try:
        for extra in ([], ["--resume"]):
            with pytest.raises(SystemExit) as e:
                main(argv + extra)
            assert "is held by a live run" in str(e.value.code) and str(e.value.code).startswith("error: --output")
            assert sorted(p.name for p in run.iterdir()) == ["_lease.json"]
    finally:
        holder.release()
    assert main(argv) == 0
    assert not (run / "_lease.json").exists() and (run / "checkpoints" / "ckpt-00000002.h5").exists()


@pytest.mark.parametrize("case", ["batch_size 0", "unroll_steps -1", "n_epochs 1.5", "empty --valid"])
def test_a_count_in_an_options_file_or_held_out_text_without_tokens_is_one_error(tmp_path, case):
    """A count in --options below 1 (or no integer), or --valid text without a token: a ValueError naming it before
    the run folder's files are written (before: ZeroDivisionError once training ran; perplexity 1.00 over 0 tokens
    recorded at each checkpoint)."""
    from elmo_pipeline.training.train import TrainConfig, train
    from tests.test_train import tiny_options
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)
    (tmp_path / "valid.txt").write_text("\n  \n")
    options, valid = tiny_options(), None
    if case == "empty --valid":
        valid, match = [str(tmp_path / "valid.txt")], "no tokens to evaluate"
    else:
        key, value = case.split()
        options[key] = float(value) if "." in value else int(value)
        match = f"options: {key} must be an integer >= 1"
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        train(TrainConfig(train_files=[str(tmp_path / "text.txt")], valid_files=valid, out_dir=str(run),
                          progress=False, threads=1, options=options, max_steps=2, export=False))
    assert case == "empty --valid" or not (run / "options.json").exists()


def test_resume_without_a_checkpoint_restarts_only_the_same_run_and_a_failed_start_leaves_no_files(tmp_path):
    """--resume finding no checkpoint: a folder holding a finished run's export, or the start files of a run of
    other options, is refused, left as it is (before: a run from scratch with default options replaced them, exit
    0); the start files of the same run (killed before its first checkpoint) are a run started again. A start that
    fails on its data (fewer windows than a batch) writes none of the run's files, so the corrected command runs
    (before: its options.json and vocab.txt made the folder a run's)."""
    import shutil
    from elmo_pipeline.training.train import TrainConfig, train
    from tests.test_train import tiny_options
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)

    def cfg(out, **kw):
        return TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(out), progress=False, threads=1,
                           log_every=1, **{"options": tiny_options(), "checkpoint_every": 1000, **kw})
    with pytest.raises(ValueError, match="fewer than batch_size"):
        train(cfg(tmp_path / "u", options=tiny_options(batch_size=4096)))
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == ["checkpoints"]
    train(cfg(tmp_path / "u", max_steps=1, export=False))
    done = tmp_path / "done"
    train(cfg(done, max_steps=2, checkpoint_every=2))
    shutil.rmtree(done / "checkpoints")
    before = {p: p.read_bytes() for p in done.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=re.escape("holds no checkpoint to resume from but a finished run's export")):
        train(cfg(done, max_steps=2, resume=True))
    assert {p: p.read_bytes() for p in done.rglob("*") if p.is_file()} == before
    early = tmp_path / "early"             # what a run killed before its first checkpoint leaves
    train(cfg(early, max_steps=1, export=False))
    shutil.rmtree(early / "checkpoints")
    with pytest.raises(ValueError, match="its files are not this command's run"):
        train(cfg(early, max_steps=1, resume=True, options=tiny_options(batch_size=8)))
    train(cfg(early, max_steps=1, resume=True, export=False))
    assert (early / "checkpoints" / "ckpt-00000001.h5").exists()


def test_resume_keeps_the_runs_seed_and_init_from_keeps_a_softmax_only_over_its_own_vocabulary(tmp_path):
    """A run resumed without its --seed continues with the seed its checkpoint records (before: the default seed's
    batch order, another model); --init-from with another --vocab-file: a new softmax for a char model (before: the
    model's softmax rows reused under other words), refused for a word-encoder model; an export whose sha256sums.txt
    leaves its vocab.txt out is refused."""
    from elmo_pipeline.training.export import export_model, load_exported
    from elmo_pipeline.training.train import TrainConfig, build_model, train
    from tests.test_train import tiny_options
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)

    def cfg(out, **kw):
        return TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(out), progress=False, threads=1,
                           checkpoint_every=2, log_every=1, **{"options": tiny_options(), **kw})
    train(cfg(tmp_path / "whole", max_steps=4, seed=7))
    train(cfg(tmp_path / "resumed", max_steps=4, seed=7, stop_after_steps=2))
    train(cfg(tmp_path / "resumed", resume=True))
    digest = [(tmp_path / d / "model" / "sha256sums.txt").read_text() for d in ("whole", "resumed")]
    assert digest[0] == digest[1]
    head, vocab, _ = load_exported(str(tmp_path / "whole" / "model"))
    (tmp_path / "other.txt").write_text("".join(t + "\n" for t in [*vocab.tokens[:3], *vocab.tokens[3:][::-1]]))
    logged = []
    from elmo_pipeline.training import train as train_module
    original, train_module._log = train_module._log, lambda text: logged.append(text)
    try:
        train(cfg(tmp_path / "ft", max_steps=1, init_from=str(tmp_path / "whole" / "model"),
                  vocab_file=str(tmp_path / "other.txt"), export=False))
    finally:
        train_module._log = original
    assert any("(softmax new)" in line for line in logged), logged
    word = tmp_path / "word"
    export_model(build_model(tiny_options("word"), vocab), vocab, str(word))
    with pytest.raises(ValueError, match="a word-encoder model's embedding rows are the words of its vocab.txt"):
        train(cfg(tmp_path / "wft", max_steps=1, options=tiny_options("word"), init_from=str(word),
                  vocab_file=str(tmp_path / "other.txt")))
    sums = word / "sha256sums.txt"
    sums.write_text("".join(line + "\n" for line in sums.read_text().splitlines() if "vocab.txt" not in line))
    with pytest.raises(ValueError, match="does not record each of its files"):
        load_exported(str(word))


@pytest.mark.parametrize("edit", [{"step": "2"}, {"options": [1]}, {"total_steps": "x"}, {"seed": -1}])
def test_a_checkpoint_meta_of_another_form_is_one_error_naming_the_file(tmp_path, edit):
    """A checkpoint whose meta holds a step, a schedule or a seed that is no count, or options that are no object:
    a ValueError naming the file (before: a TypeError or AttributeError from wherever the value was used)."""
    import json as json_module
    from elmo_pipeline.training.checkpoint import read_meta
    from elmo_pipeline.training.train import TrainConfig, latest_checkpoint, train
    from tests.test_train import tiny_options
    (tmp_path / "text.txt").write_text("the cat sat on the mat .\nthe dog ran .\n" * 20)
    train(TrainConfig(train_files=[str(tmp_path / "text.txt")], out_dir=str(tmp_path / "run"), progress=False,
                      threads=1, options=tiny_options(), max_steps=1, export=False))
    ckpt = latest_checkpoint(str(tmp_path / "run"))
    with h5py.File(ckpt, "a") as f:
        f.attrs["meta"] = json_module.dumps({**json_module.loads(f.attrs["meta"]), **edit})
    with pytest.raises(ValueError, match=re.escape(f"{ckpt}: not a readable checkpoint")):
        read_meta(ckpt)
