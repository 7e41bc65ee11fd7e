"""`elmo-pipeline elmo`: flags and the AllenNLP HDF5 layout."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder
from elmo_pipeline.pipeline.cli import main
from tests.test_model_resolve import LOCAL_SPELLINGS

LINES = ["The cat sat on the mat .", "", "Zürich is 東京 's sister ?", "a"]


@pytest.fixture
def input_file(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return p


def _run(model_files, *args):
    options, weights = model_files
    return main(["elmo", *map(str, args), "--options-file", options, "--weight-file", weights])


@pytest.mark.parametrize("batching", [["--batch-size", "2"], ["--max-tokens-per-batch", "12"]])
def test_all_layers_and_sentence_index(tiny_model_files, input_file, tmp_path, caplog, batching):
    out = tmp_path / "all.hdf5"
    assert _run(tiny_model_files, input_file, out, "--all", *batching) == 0
    e = ElmoEmbedder(*tiny_model_files)
    with h5py.File(out, "r") as f:
        assert sorted(f.keys()) == ["0", "1", "2", "3", "sentence_to_index"]
        for i, line in enumerate(LINES):
            assert f[str(i)].shape == (3, len(line.split()), 16)
            assert f[str(i)].dtype == np.float32
            np.testing.assert_allclose(f[str(i)][...], e.embed_sentence(line.split()), atol=1e-6)
        index = json.loads(f["sentence_to_index"][0])
        assert index == {line: str(i) for i, line in enumerate(LINES)}
    assert "line 1 is blank" in caplog.text


def test_top_and_average(tiny_model_files, input_file, tmp_path):
    e = ElmoEmbedder(*tiny_model_files)
    full = e.embed_sentence(LINES[0].split())
    for flag, expect in (("--top", full[-1]), ("--average", full.mean(axis=0))):
        out = tmp_path / f"{flag}.hdf5"
        assert _run(tiny_model_files, input_file, out, flag, "--forget-sentences") == 0
        with h5py.File(out, "r") as f:
            assert "sentence_to_index" not in f
            np.testing.assert_allclose(f["0"][...], expect, atol=1e-6)
            assert f["1"].shape == (0, 16)


def test_sentence_keys(tiny_model_files, tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("one two\nthree\n", encoding="utf-8")
    out = tmp_path / "k.hdf5"
    assert _run(tiny_model_files, p, out, "--top", "--use-sentence-keys") == 0
    with h5py.File(out, "r") as f:
        assert f["one two"].shape == (2, 16) and f["three"].shape == (1, 16)


def test_sentence_keys_refuse_blank_lines(tiny_model_files, input_file, tmp_path):
    with pytest.raises(SystemExit, match="use-sentence-keys"):
        _run(tiny_model_files, input_file, tmp_path / "x.hdf5", "--top", "--use-sentence-keys")


def test_token_budget_refused_when_stateful(tiny_model_files, input_file, tmp_path):
    with pytest.raises(SystemExit, match="max-tokens-per-batch"):
        _run(tiny_model_files, input_file, tmp_path / "x.hdf5", "--all", "--state", "stateful",
             "--max-tokens-per-batch", "100")


def test_a_window_overlap_without_windows_is_refused(tiny_model_files, input_file, tmp_path):
    """--window-overlap alone (the command's --window-tokens defaults to 0: whole sentences) was dropped without a
    word, exit 0 (`run`'s windows are on by default, so there it applies)."""
    with pytest.raises(SystemExit, match="error: --window-overlap needs --window-tokens"):
        _run(tiny_model_files, input_file, tmp_path / "x.hdf5", "--all", "--window-overlap", "50")
    assert not (tmp_path / "x.hdf5").exists()


def test_stateful_matches_consecutive_batches(tiny_model_files, input_file, tmp_path):
    out = tmp_path / "s.hdf5"
    assert _run(tiny_model_files, input_file, out, "--all", "--state", "stateful", "--batch-size", "2") == 0
    e = ElmoEmbedder(*tiny_model_files, state="stateful")
    expect = e.embed_batch([l.split() for l in LINES[:2]]) + e.embed_batch([l.split() for l in LINES[2:]])
    with h5py.File(out, "r") as f:
        for i, v in enumerate(expect):
            np.testing.assert_allclose(f[str(i)][...], v, atol=1e-6)


@pytest.mark.slow
def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.cli", "elmo", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in ("--all", "--top", "--average", "--options-file", "--weight-file", "--batch-size",
                 "--cuda-device", "--forget-sentences", "--use-sentence-keys", "--state"):
        assert flag in r.stdout


@pytest.mark.parametrize("spelling", LOCAL_SPELLINGS)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_input_that_is_no_regular_file_is_one_error_line(tiny_model_files, tmp_path, kind, spelling):
    """A FIFO (its open blocks until a writer comes) or a device (/dev/zero: a line that never ends) as INPUT_FILE
    is one `error:` line, never read (it hung the command), however the path is spelled (`file:/dev/zero` and
    `blockcache::/dev/zero` hung it: only a plain path and file:// were checked)."""
    import os
    from tests.test_model_resolve import _fifo_with_a_writer
    path = {"fifo": str(tmp_path / "in.txt"), "device": "/dev/zero"}[kind]
    if kind == "fifo":
        _fifo_with_a_writer(path)
    out = tmp_path / "out.hdf5"
    with pytest.raises(SystemExit, match="not a regular file") as e:
        _run(tiny_model_files, spelling.format(path), out, "--top")
    assert str(e.value.code).startswith("error: INPUT_FILE ") and not os.path.lexists(out)


def _foreign(tmp_path, kind):
    """Something at OUTPUT_FILE that the command did not write, and what it holds (to check it is left as it was)."""
    import os
    user = tmp_path / "user.txt"
    user.write_bytes(b"the user's own data\n")
    out = tmp_path / "out.hdf5"
    if kind == "file":
        out.write_bytes(b"the user's own data\n")
    elif kind == "hdf5 of another writer":
        with h5py.File(out, "w") as f:
            f["0"] = np.zeros((3, 2, 4), np.float32)
    elif kind == "link to a user's file":
        out.symlink_to(user)
    elif kind == "folder":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    elif kind == "fifo":
        os.mkfifo(out)
    return out, user


def _state(path):
    import os
    st = os.lstat(path)
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns,
            path.read_bytes() if path.is_file() and not path.is_symlink() else None)


@pytest.mark.parametrize("kind", ["file", "hdf5 of another writer", "link to a user's file", "folder", "fifo"])
def test_an_output_file_the_command_did_not_write_is_refused_and_left(tiny_model_files, input_file, tmp_path, kind):
    """OUTPUT_FILE holding a user's file, an HDF5 file without the command's mark, a link (never written through), a
    folder or a FIFO: one `error:` line naming it before anything is read, and it is left as it was (the command
    truncated the file, wrote through the link into the user's file)."""
    out, user = _foreign(tmp_path, kind)
    before, user_before = _state(out), user.read_bytes()
    with pytest.raises(SystemExit, match="exists and is") as e:
        _run(tiny_model_files, input_file, out, "--all")
    assert str(e.value.code).startswith(f"error: OUTPUT_FILE {out} exists and is ")
    assert _state(out) == before and user.read_bytes() == user_before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.txt", "user.txt", "out.hdf5"])


def test_the_commands_own_file_is_replaced_whole_and_a_killed_runs_temp_file_removed(tiny_model_files, input_file,
                                                                                    tmp_path):
    """A rerun replaces the command's own earlier file (its root attribute marks it) at once, when the new one is
    whole; a temporary file a killed run left beside it is removed; the layout is AllenNLP's (the mark is an attribute,
    no dataset)."""
    out = tmp_path / "out.hdf5"
    assert _run(tiny_model_files, input_file, out, "--all") == 0
    left = tmp_path / ("out.hdf5.tmp-" + "0" * 32)
    left.write_bytes(b"half an HDF5 file")
    from elmo_pipeline.fsio import held_temp
    with held_temp(str(out)) as live:       # another command's, writing now (an overlapping run): never removed
        assert _run(tiny_model_files, input_file, out, "--top") == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.txt", "out.hdf5", os.path.basename(live)])
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["0", "1", "2", "3", "sentence_to_index"] and f["0"].ndim == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.hdf5"]


def test_a_file_placed_at_the_output_while_the_command_ran_is_left(tmp_path):
    """pipeline/elmo_command.place_output: a file that appeared at OUTPUT_FILE after the command looked (nothing
    there), or that replaced its own earlier file, is never replaced: one `error:` line, the file as it was."""
    from elmo_pipeline.pipeline.elmo_command import claim_output, place_output
    out = tmp_path / "out.hdf5"
    assert claim_output(str(out)) is None
    out.write_bytes(b"placed meanwhile")
    tmp = tmp_path / "new.tmp"
    tmp.write_bytes(b"new")
    with pytest.raises(SystemExit, match="placed there while the command ran"):
        place_output(str(tmp), str(out), None)
    assert out.read_bytes() == b"placed meanwhile"
    import os
    seen = os.lstat(out)
    out.unlink()
    out.write_bytes(b"another one")
    with pytest.raises(SystemExit, match="placed there while the command ran"):
        place_output(str(tmp), str(out), seen)
    assert out.read_bytes() == b"another one"


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_command_killed_while_it_writes_leaves_the_earlier_file_whole(tiny_model_files, tmp_path, sig):
    """A real `elmo-pipeline elmo` killed while it writes its HDF5 file: the earlier output at OUTPUT_FILE is as it
    was (the command used to truncate it first, leaving a damaged file), and the same command then finishes. SIGTERM
    ends it with 143 and its temporary file gone; after SIGKILL the rerun removes it."""
    import hashlib
    import os
    import signal
    import time
    from tests.conftest import REPO
    small = tmp_path / "small.txt"
    small.write_text("The cat sat .\nA dog ran .\n")
    out = tmp_path / "out.hdf5"
    assert _run(tiny_model_files, small, out, "--all") == 0
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    big = tmp_path / "big.txt"
    big.write_text("".join(f"the cat {i} sat on the mat and the dog ran far away .\n" for i in range(20000)))
    cmd = [sys.executable, "-m", "elmo_pipeline", "elmo", str(big), str(out), "--all", "--options-file",
           tiny_model_files[0], "--weight-file", tiny_model_files[1]]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and p.poll() is None:    # writing: its file grew, or the output changed
            temps = [q for q in tmp_path.iterdir() if ".tmp-" in q.name]
            if (temps and temps[0].stat().st_size > 100_000) or os.stat(out).st_size != len(out.read_bytes()) \
                    or hashlib.sha256(out.read_bytes()).hexdigest() != digest:
                break
            time.sleep(0.05)
        assert p.poll() is None, "the command ended before it was killed"
        p.send_signal(getattr(signal, sig))
    finally:
        p.wait(timeout=60)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    if sig == "SIGTERM":        # unwound as from a Ctrl-C (pipeline/cli.py): 143, its temporary file removed by itself
        assert p.returncode == 143 and not [q for q in tmp_path.iterdir() if ".tmp-" in q.name], p.returncode
    else:
        assert p.returncode == -signal.SIGKILL
    r = subprocess.run(cmd[:4] + [str(small)] + cmd[5:], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["big.txt", "out.hdf5", "small.txt"]


@pytest.mark.parametrize("name", ["", "{tmp}/", "{tmp}/new/"])
def test_an_output_file_name_that_names_no_file_is_one_error_line(tiny_model_files, input_file, tmp_path, name):
    with pytest.raises(SystemExit, match="names no file"):
        _run(tiny_model_files, input_file, name.format(tmp=tmp_path), "--all")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_the_mark_is_read_only_as_one_short_string(tmp_path):
    """claim_output's look at a file there reads its `written_by` attribute only when it is one short string (checked
    from its metadata first: a hostile file's huge attribute is never read)."""
    from elmo_pipeline.pipeline.elmo_command import _ours
    for name, value in {"many": np.array([b"elmo-pipeline elmo"] * 100_000), "str": "elmo-pipeline elmo",
                        "bytes": np.bytes_(b"elmo-pipeline elmo"), "other": "someone else"}.items():
        with h5py.File(tmp_path / f"{name}.hdf5", "w", libver="latest") as f:
            f.attrs["written_by"] = value
        assert _ours(str(tmp_path / f"{name}.hdf5")) == (name in ("str", "bytes")), name


def test_a_folder_named_like_a_temporary_file_is_left_and_no_failure(tiny_model_files, input_file, tmp_path):
    """A folder beside OUTPUT_FILE named as the command's temporary files are (OUTPUT_FILE.tmp-<32 hex>) is nobody's
    temporary file: left as it is, and the command writes OUTPUT_FILE (it failed every run with `Is a directory`)."""
    out = tmp_path / "out.hdf5"
    folder = tmp_path / ("out.hdf5.tmp-" + "a" * 32)
    folder.mkdir()
    assert _run(tiny_model_files, input_file, out, "--top") == 0
    assert folder.is_dir() and h5py.is_hdf5(out)


def test_an_output_file_name_as_long_as_the_folder_allows_is_written(tiny_model_files, input_file, tmp_path):
    """OUTPUT_FILE with a 250-byte name: written (its temporary name, OUTPUT_FILE + ".tmp-<32 hex>", was over the
    255 bytes a name may have, so every run failed with `File name too long` where AllenNLP's command wrote it), and a
    killed run's temporary file of that name is removed by the next run."""
    from elmo_pipeline.fsio.fs import temp_name
    out = tmp_path / ("é" * 10 + "x" * 226 + ".hdf5")
    assert len(os.fsencode(out.name)) == 251
    assert _run(tiny_model_files, input_file, out, "--top") == 0
    left = temp_name(str(out))
    assert len(os.fsencode(os.path.basename(left))) <= 255
    open(left, "wb").close()
    assert _run(tiny_model_files, input_file, out, "--all") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.txt", out.name])
    with h5py.File(out, "r") as f:
        assert f["0"].ndim == 3


def test_the_mark_vouches_only_for_the_file_claim_output_saw(tiny_model_files, input_file, tmp_path, monkeypatch):
    """claim_output() took the stat of the file at OUTPUT_FILE by name, then read the mark by name again: a file of
    the command's swapped in between (and the user's put back after) vouched for the user's file, which place_output
    then replaced (lost). The mark is read from the file the stat describes: the user's file is refused, left."""
    from elmo_pipeline.pipeline import elmo_command
    out, ours, kept = tmp_path / "out.hdf5", tmp_path / "ours.hdf5", tmp_path / "kept"
    assert _run(tiny_model_files, input_file, ours, "--top") == 0
    out.write_bytes(b"the user's results")
    real_lstat, real_ours = os.lstat, elmo_command._ours

    def lstat_then_swap(p, *a, **k):
        st = real_lstat(p, *a, **k)
        if str(p) == str(out) and not kept.exists():
            os.rename(out, kept)                    # the user's file out of the way, the command's own in its place
            os.link(ours, out)
        return st

    def ours_then_swap_back(*a):
        found = real_ours(*a)
        if kept.exists():
            os.replace(kept, out)
        return found
    monkeypatch.setattr(elmo_command.os, "lstat", lstat_then_swap)
    monkeypatch.setattr(elmo_command, "_ours", ours_then_swap_back)
    try:
        before = elmo_command.claim_output(str(out))
    except SystemExit as e:
        assert "a file this command did not write" in str(e.code)
    else:
        monkeypatch.undo()
        tmp = tmp_path / "new.tmp"
        tmp.write_bytes(b"new")
        elmo_command.place_output(str(tmp), str(out), before)
    monkeypatch.undo()
    assert out.read_bytes() == b"the user's results"
