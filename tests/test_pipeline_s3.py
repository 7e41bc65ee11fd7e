"""The pipeline reading from and writing to an S3 API on loopback (moto's server, started here)."""
import json

import numpy as np
import pytest

from elmo_pipeline.pipeline.run import run
from tests.pipeline_helpers import moto_s3

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes

DOC = "Seagulls argued over the last chip on the pier. Nobody intervened."


@pytest.fixture(scope="module")
def s3():
    with moto_s3("bucket") as endpoint_fs:
        yield endpoint_fs


def test_s3_in_and_out(s3, tiny_model_files):
    endpoint, fs = s3
    fs.pipe("bucket/in/docs.txt", (DOC + "\n").encode())
    argv = ["--input", "s3://bucket/in/*.txt", "--output", "s3://bucket/out", "--progress", "off",
            "--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1], "--torch-threads", "1",
            "--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing"]
    run(argv)
    fs.invalidate_cache()
    m = json.loads(fs.cat("bucket/out/manifest.json"))
    assert m["counts"]["sentences"] == 2 and fs.exists("bucket/out/_SUCCESS")
    assert not fs.exists("bucket/out/_staging")
    assert sorted(fs.ls("bucket/out/parquet")) == ["bucket/out/parquet/part-00000-of-00001.parquet"]

    import duckdb
    import h5py
    import pyarrow.dataset as ds
    t = ds.dataset("bucket/out/parquet", filesystem=fs, format="parquet").to_table()
    assert t.column("id").to_pylist() == ["docs.txt:1#0", "docs.txt:1#1"]
    con = duckdb.connect()
    con.register_filesystem(fs)
    assert con.sql("SELECT count(*) FROM 's3://bucket/out/parquet/*.parquet'").fetchall() == [(2,)]
    with fs.open("bucket/out/" + m["shards"][0]["hdf5"], "rb") as f, h5py.File(f) as h:
        v = h["docs.txt:1#1"][...]
    from elmo_pipeline.model.embedder import ElmoEmbedder
    alone = ElmoEmbedder(*tiny_model_files).embed_sentence(t.column("tokens")[1].as_py())
    assert np.abs(v - alone).max() <= 1e-5
