"""Helpers for the pipeline tests: run the pipeline, read its outputs back, an S3 API on loopback."""
import contextlib
import json
import os
import socket

import h5py
import numpy as np
import pyarrow.dataset as ds
import pytest

from elmo_pipeline.pipeline.run import run


def run_pipeline(model_files, inp, out, *extra):
    """Run pipeline.run on FnApiRunner with the given model files; returns (result, manifest)."""
    options, weights = model_files
    argv = ["--input", *([inp] if isinstance(inp, str) else inp), "--output", out,
            "--options-file", options, "--weight-file", weights, "--torch-threads", "1", "--progress", "off", *extra]
    if isinstance(inp, list):  # several inputs: repeat the flag
        argv = [a for x in inp for a in ("--input", x)] + argv[1 + len(inp):]
    result = run(argv)
    with open(os.path.join(out, "manifest.json")) as f:
        return result, json.load(f)


def parquet_rows(out, manifest):
    """{sentence id: row dict} from the manifest's Parquet shards (read with pyarrow.dataset)."""
    files = [os.path.join(out, s["parquet"]) for s in manifest["shards"]]
    table = ds.dataset(files, format="parquet").to_table()
    return {r["id"]: r for r in table.to_pylist()}


def hdf5_arrays(out, manifest):
    arrays = {}
    for s in manifest["shards"]:
        with h5py.File(os.path.join(out, s["hdf5"])) as f:
            for k in f:
                arrays[k] = f[k][...]
    return arrays


def layer_arrays(row, names):
    return [np.array(row[n], dtype=np.float32) for n in names]


@contextlib.contextmanager
def moto_s3(bucket: str):
    """moto's S3 server on a free 127.0.0.1 port, emptied, with `bucket` created: yields (endpoint URL, s3fs
    filesystem)."""
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import urllib.request

    import s3fs
    endpoint = f"http://127.0.0.1:{port}"
    # moto's servers in one process share their state: start from none of an earlier test's buckets
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30).close()
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
    fs.mkdir(bucket)
    try:
        yield endpoint, fs
    finally:
        server.stop()


def embed_failing(model_files, batch, marker="BOOM", **kwargs):
    """EmbedBatches (kwargs: window, overlap, max_tokens) on one batch of Items with a real model whose
    embed_batch raises ValueError("boom") for any sentence holding `marker`: (dead letters, EmbeddedBatches)."""
    from apache_beam.pvalue import TaggedOutput
    from apache_beam.utils.windowed_value import WindowedValue

    from elmo_pipeline.model.resolve import ModelSpec
    from elmo_pipeline.transforms.chain import DEAD
    from elmo_pipeline.transforms.embed_step import EmbedBatches
    d = EmbedBatches(ModelSpec(*model_files, device="cpu"), **kwargs)
    d.setup()
    real = d.embedder.embed_batch

    def failing(sentences, *a, **k):
        if any(marker in s for s in sentences):
            raise ValueError("boom")
        return real(sentences, *a, **k)
    d.embedder.embed_batch = failing
    try:
        d.start_bundle()
        outs = list(d.process(batch)) + [o.value if isinstance(o, WindowedValue) else o for o in d.finish_bundle()]
    finally:
        d.embedder.embed_batch = real
        d.teardown()
    assert {o.tag for o in outs if isinstance(o, TaggedOutput)} <= {DEAD}
    return ([o.value for o in outs if isinstance(o, TaggedOutput)],
            [o for o in outs if not isinstance(o, TaggedOutput)])
