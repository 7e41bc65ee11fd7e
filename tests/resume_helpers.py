"""Helpers for the reliability tests: a corpus, the pipeline as a real subprocess, output comparison."""
import json
import os
import posixpath
import random
import subprocess
import sys

import fsspec
import h5py
import numpy as np
import pytest
import pyarrow.parquet as pq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the a harbour ship keeper light rain fell on over under three days fishermen stayed home counted "
         "every evening most nights none well-known storm came north wind blew sails boats tide gulls pier "
         "rope net dawn").split()


def write_corpus(path, n_docs=16, seed=7):
    """Documents (one per line) of 1-4 sentences of 3-25 words; a blank line too."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))).capitalize() + rng.choice(".!?")
                 for _ in range(rng.randint(1, 4))]
        docs.append(" ".join(sents))
    docs.insert(3, "")
    with open(path, "w") as f:
        f.write("\n".join(docs) + "\n")
    return path


def argv(model_files, inp, out, *extra):
    options, weights = model_files
    return ["--input", inp, "--output", out, "--options-file", options, "--weight-file", weights,
            "--torch-threads", "1", "--progress", "off", *extra]


def run_subprocess(args, crash_at=None, timeout=240):
    """`python -m elmo_pipeline.pipeline.run ARGS` in a fresh process (optionally with the SIGKILL fault hook set)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ELMO_PIPELINE_CRASH_AT", None)
    if crash_at:
        env["ELMO_PIPELINE_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_output(out, fs=None):
    """(manifest, {id: parquet row}, {hdf5 key: array}, [dead letter ids]) of a finished output, checking on
    the way that it is whole: _SUCCESS, no staging left, every shard file listed exactly once and no
    other file under the shard folders, no sentence twice."""
    fs = fs or fsspec.filesystem("file")
    root = out.split("://", 1)[-1]
    fs.invalidate_cache()
    assert fs.exists(posixpath.join(root, "_SUCCESS")) and not fs.exists(posixpath.join(root, "_staging"))
    m = json.loads(fs.cat_file(posixpath.join(root, "manifest.json")))
    listed = [s[f] for s in m["shards"] for f in ("parquet", "hdf5") if f in s]
    listed += [d["path"] for d in m["dead_letter_files"]]
    present = sorted(posixpath.relpath(p, root) for sub in ("parquet", "hdf5", "dead_letters")
                     for p in (fs.find(posixpath.join(root, sub)) if fs.exists(posixpath.join(root, sub)) else []))
    assert sorted(listed) == present, (listed, present)
    rows, arrays, ids = {}, {}, []
    for s in m["shards"]:
        with fs.open(posixpath.join(root, s["parquet"]), "rb") as f:
            t = pq.read_table(f)
        assert t.num_rows == s["sentences"]
        for r in t.to_pylist():
            ids.append(r["id"])
            rows[r["id"]] = r
        with fs.open(posixpath.join(root, s["hdf5"]), "rb") as f, h5py.File(f) as h:
            assert len(h) == s["sentences"]
            for k in h:
                assert k not in arrays, f"{k} twice"
                arrays[k] = h[k][...]
    assert len(ids) == len(set(ids)), "a sentence was written twice"
    dead = sorted(json.loads(line)["id"] for d in m["dead_letter_files"]
                  for line in fs.cat_file(posixpath.join(root, d["path"])).decode().splitlines())
    return m, rows, arrays, dead


LAYERS = ("layer_0", "layer_1", "layer_2")


HOW = ("sentences_embedded", "sentences_deduplicated",     # counts of how sentences were written (--dedupe, --reuse)
       "sentences_reused", "sentences_reused_by_source")


def assert_same_output(a, b, tol=1e-6):
    """Two read_output() results hold the same sentences, ids, counts (but how they were written: HOW) and
    vectors (within `tol`)."""
    (ma, ra, ha, da), (mb, rb, hb, db) = a, b
    assert {k: v for k, v in ma["counts"].items() if k not in HOW} == \
        {k: v for k, v in mb["counts"].items() if k not in HOW}
    assert sorted(ra) == sorted(rb) and sorted(ha) == sorted(hb) and da == db
    worst = 0.0
    for sid, x in ra.items():
        y = rb[sid]
        assert {k: v for k, v in x.items() if k not in LAYERS} == {k: v for k, v in y.items() if k not in LAYERS}
        for k in LAYERS:
            worst = max(worst, float(np.abs(np.array(x[k], np.float32) - np.array(y[k], np.float32)).max(initial=0)))
    for k in ha:
        worst = max(worst, float(np.abs(ha[k] - hb[k]).max(initial=0)))
    assert worst <= tol, worst
    return worst


def assert_flag_changes_no_byte(tmp_path, model_files, flag, values, *extra):
    """The pipeline on a dirty corpus (dead letters included) once per value of `flag`: equal outputs, Parquet and
    HDF5 files byte for byte."""
    from elmo_pipeline.pipeline.run import main
    from tests.test_dask import dirty_corpus
    files = dirty_corpus(tmp_path / "corpus")
    outs = [str(tmp_path / f"out-{v}") for v in values]
    for value, out in zip(values, outs):
        assert main(argv(model_files, files, out, flag, value, *extra)) == 0
    for out in outs[1:]:
        assert_same_output(read_output(outs[0]), read_output(out), tol=0)
        for sub in ("parquet", "hdf5"):
            names = sorted(os.listdir(os.path.join(outs[0], sub)))
            assert names == sorted(os.listdir(os.path.join(out, sub)))
            for n in names:
                with open(os.path.join(outs[0], sub, n), "rb") as a, open(os.path.join(out, sub, n), "rb") as b:
                    assert a.read() == b.read(), n


# shared by the crash-resume and concurrent-run tests (import the fixtures into the test module)
SMALL = ("--shard-sentences", "4", "--max-tokens-per-batch", "256")   # 47 sentences: 12 shards, 5 batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "docs.txt"))


@pytest.fixture(scope="module")
def reference(corpus, tiny_model_files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "out")
    from elmo_pipeline.pipeline.run import main
    assert main(argv(tiny_model_files, corpus, out, *SMALL)) == 0
    ref = read_output(out)
    assert ref[0]["counts"]["sentences"] == ref[0]["counts"]["sentences_written"] > 40
    assert len(ref[0]["shards"]) >= 10
    return ref
