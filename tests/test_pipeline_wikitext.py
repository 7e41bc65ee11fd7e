"""Acceptance: WikiText-2 valid.txt (raw text) end to end, on 1 and on 2 worker processes (tiny random biLM)."""
import os

import numpy as np
import pytest

from elmo_pipeline.model.embedder import ElmoEmbedder
from tests.conftest import shared_path
from tests.pipeline_helpers import hdf5_arrays, layer_arrays, parquet_rows, run_pipeline
from elmo_pipeline.tokenization import tokenize_document
from elmo_pipeline.formats.hdf5 import hdf5_key

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes


@pytest.fixture(scope="module")
def valid(tmp_path_factory, tiny_model_files):
    path = shared_path("data", "wikitext-2", "valid.txt")
    out = str(tmp_path_factory.mktemp("valid") / "out")
    _, manifest = run_pipeline(tiny_model_files, path, out, "--shard-sentences", "3000")
    return path, out, manifest


def test_valid_every_row_equals_the_sentence_alone(valid, tiny_model_files):
    path, out, manifest = valid
    with open(path, encoding="utf-8", newline="\n") as f:
        lines = f.read().split("\n")
    docs = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    expected = {f"valid.txt:{n}#{i}": s for n, line in docs for i, s in enumerate(tokenize_document(line))}
    c = manifest["counts"]
    assert c["documents"] == len(docs) and c["sentences"] == c["sentences_written"] == len(expected)
    assert c["tokens_written"] == sum(len(s.tokens) for s in expected.values()) and c["dead_letters"] == 0
    assert len(manifest["shards"]) >= 3

    rows = parquet_rows(out, manifest)
    h5 = hdf5_arrays(out, manifest)
    assert set(rows) == set(expected) and len(h5) == len(expected)
    emb = ElmoEmbedder(*tiny_model_files)
    worst = 0.0
    for sid, r in rows.items():
        doc = lines[int(r["doc_id"].rsplit(":", 1)[1]) - 1]
        assert r["sentence_index"] == int(sid.rsplit("#", 1)[1])
        assert tuple(r["tokens"]) == expected[sid].tokens
        assert [doc[a:b] for a, b in r["token_offsets"]] == [{"@-@": "-"}.get(t, t) for t in r["tokens"]]
        alone = emb.embed_sentence(r["tokens"])
        l0, l1, l2 = layer_arrays(r, ["layer_0", "layer_1", "layer_2"])
        worst = max(worst, np.abs(l0 - alone[0, :, : alone.shape[2] // 2]).max(),
                    np.abs(np.stack([l1, l2]) - alone[1:]).max(), np.abs(h5[hdf5_key(sid)] - alone).max())
    assert worst <= 1e-5


def test_valid_two_worker_processes_give_identical_content(valid, tiny_model_files, tmp_path):
    path, out1, m1 = valid
    out2 = str(tmp_path / "out2")
    _, m2 = run_pipeline(tiny_model_files, path, out2, "--direct_num_workers", "2",
                         "--direct_running_mode", "multi_processing", "--shard-sentences", "3000")
    assert m2["counts"] == m1["counts"]
    r1, r2 = parquet_rows(out1, m1), parquet_rows(out2, m2)
    assert r1.keys() == r2.keys()
    layers = ["layer_0", "layer_1", "layer_2"]
    worst = 0.0
    for sid in r1:
        a, b = r1[sid], r2[sid]
        assert {k: v for k, v in a.items() if k not in layers} == {k: v for k, v in b.items() if k not in layers}
        worst = max(worst, *(np.abs(x - y).max() for x, y in zip(layer_arrays(a, layers), layer_arrays(b, layers))))
    h1, h2 = hdf5_arrays(out1, m1), hdf5_arrays(out2, m2)
    assert h1.keys() == h2.keys()
    worst = max(worst, *(np.abs(h1[k] - h2[k]).max() for k in h1))
    # Bundles (so batches, so padded shapes) differ between 1 and 2 workers; float32 kernels round
    # differently per shape, so vectors agree to round-off, not bit for bit.
    assert worst <= 1e-6, worst
