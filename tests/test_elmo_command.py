"""`elmo-pipeline elmo`: flags and the AllenNLP HDF5 layout."""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder
from elmo_pipeline.pipeline.cli import main

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
