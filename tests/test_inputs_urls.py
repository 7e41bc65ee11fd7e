"""Inputs and model files named by path or URL: one file named twice counts once (fsio.expand), presigned URLs
(a query string, whose ? is no wildcard) work for model files and inputs, and a URL whose storage package is
not installed ends in one line naming what to install (exit 2)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from elmo_pipeline.fsio import expand
from elmo_pipeline.pipeline.run import main
from tests.model_server import ModelServer
from tests.pipeline_helpers import hdf5_arrays, parquet_rows
from tests.resume_helpers import REPO

TEXT = "Seagulls argued over the last chip on the pier.\nThe keeper lit the lamp at dusk.\n"


def test_one_file_however_spelled_is_expanded_once(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text(TEXT)
    (tmp_path / "y.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    x = str(tmp_path / "dir" / "x.txt")
    assert expand(["dir/x.txt", "./dir/x.txt", "dir//x.txt", "dir/./x.txt", "y.txt/../dir/x.txt", x,
                   f"file://{x}", f"file://{tmp_path}//dir/x.txt", "dir/*.txt"]) == [x]
    assert expand(["dir/x.txt", "y.txt", "./y.txt"]) == [x, str(tmp_path / "y.txt")]


def run_args(tiny_model_files, out, *inputs, options=None, weights=None):
    return [*(a for i in inputs for a in ("--input", i)), "--output", str(out),
            "--options-file", options or tiny_model_files[0], "--weight-file", weights or tiny_model_files[1],
            "--torch-threads", "1", "--progress", "off"]


def test_the_same_file_named_twice_counts_once(tiny_model_files, tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    assert main(run_args(tiny_model_files, tmp_path / "out", "dir/x.txt", "./dir/x.txt", "dir//x.txt")) == 0
    m = json.load(open(tmp_path / "out" / "manifest.json"))
    assert m["inputs"] == [str(tmp_path / "dir" / "x.txt")]
    assert m["counts"]["documents"] == 2 and m["counts"]["input_records"] == 2
    assert sorted(parquet_rows(str(tmp_path / "out"), m)) == ["x.txt:1#0", "x.txt:2#0"]
    assert sorted(hdf5_arrays(str(tmp_path / "out"), m)) == ["x.txt:1#0", "x.txt:2#0"]


PRESIGNED = "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=600&X-Amz-Signature=0a1b2c&sig=d3e4"


@pytest.mark.slow
def test_presigned_urls_for_model_files_and_inputs(tiny_model_files, tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "in.txt"
    local.write_text(TEXT)
    with ModelServer() as server:
        for name, path in (("options.json", tiny_model_files[0]), ("weights.hdf5", tiny_model_files[1]),
                           ("in.txt", str(local))):
            server.files[f"/b/{name}{PRESIGNED}"] = open(path, "rb").read()
        url = f"{server.url}/b/{{}}{PRESIGNED}"
        assert main(run_args(tiny_model_files, tmp_path / "remote", url.format("in.txt"), url.format("in.txt"),
                             options=url.format("options.json"), weights=url.format("weights.hdf5"))) == 0
        with pytest.raises(FileNotFoundError, match="matches no file"):
            expand([url.format("gone.txt")])
        # the query reached the server: no glob expansion, no query dropped
        assert {p for m, p in server.requests} >= {f"/b/{n}{PRESIGNED}" for n in ("options.json", "weights.hdf5", "in.txt")}
    assert main(run_args(tiny_model_files, tmp_path / "local", str(local))) == 0
    remote, plain = (json.load(open(tmp_path / o / "manifest.json")) for o in ("remote", "local"))
    assert remote["counts"]["documents"] == 2 and remote["model"]["weights_sha256"] == plain["model"]["weights_sha256"]
    got, want = hdf5_arrays(str(tmp_path / "remote"), remote), hdf5_arrays(str(tmp_path / "local"), plain)
    assert sorted(got) == [f"in.txt?X-Amz-Algorithm=***&X-Amz-Expires=***&X-Amz-Signature=***&sig=***:{n}#0"
                           for n in (1, 2)]
    for key, v in got.items():        # the same vectors, bit for bit, as from the local files
        np.testing.assert_array_equal(v, want["in.txt:" + key.rsplit(":", 1)[1]])


def without(package: str, tmp_path, args) -> subprocess.CompletedProcess:
    """`python -m elmo_pipeline.pipeline.run ARGS` in a process where `import PACKAGE` fails (sys.modules[PACKAGE] = None)."""
    site = tmp_path / f"without-{package}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO]), OMP_NUM_THREADS="1",
               ELMO_PIPELINE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("package,where,install", [
    ("s3fs", "input", "pip install 'elmo-pipeline[s3]'"),
    ("s3fs", "model", "pip install 'elmo-pipeline[s3]'"),
    ("aiohttp", "model", "pip install 'fsspec[http]' requests"),
])
def test_a_url_whose_storage_is_not_installed(package, where, install, tiny_model_files, tmp_path):
    corpus = tmp_path / "in.txt"
    corpus.write_text(TEXT)
    url = {"s3fs": "s3://bucket/m", "aiohttp": "https://127.0.0.1:9/m"}[package]
    if where == "input":
        args = run_args(tiny_model_files, tmp_path / "out", f"{url}/in.txt")
    else:
        args = run_args(tiny_model_files, tmp_path / "out", str(corpus), options=f"{url}/options.json",
                        weights=f"{url}/weights.hdf5")
    p = without(package, tmp_path, args)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and package in line and install in line, line
    assert not (tmp_path / "out").exists()
