"""downstream readers over an object store: a real pipeline output uploaded to moto's S3 server on loopback."""
import json
import os
import socket

import numpy as np
import pytest

from downstream.readers import ElmoDataset, ElmoIterableDataset, ElmoOutput, to_arrow_table
from tests.pipeline_helpers import run_pipeline


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import s3fs
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
    fs.mkdir("bucket")
    yield endpoint, fs
    server.stop()


def test_readers_on_s3(s3, tmp_path, tiny_model_files):
    endpoint, fs = s3
    (tmp_path / "s.txt").write_text("the first line\nand a second one\nthird\n")
    out = str(tmp_path / "out")
    _, manifest = run_pipeline(tiny_model_files, str(tmp_path / "s.txt"), out, "--input-format", "lines",
                               "--tokenizer", "whitespace", "--shard-sentences", "2")
    for root, _, files in os.walk(out):
        for name in files:
            local = os.path.join(root, name)
            fs.put_file(local, "bucket/elmo/" + os.path.relpath(local, out))
    so = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    remote, local = ElmoOutput("s3://bucket/elmo", so), ElmoOutput(out)
    assert remote.manifest == json.load(open(os.path.join(out, "manifest.json")))
    for fmt in ("parquet", "hdf5"):
        a, b = list(remote.sentences(fmt)), list(local.sentences(fmt))
        assert [r["id"] for r in a] == [r["id"] for r in b]
        assert sorted(r["id"] for r in a) == ["s.txt:1#0", "s.txt:2#0", "s.txt:3#0"]
        assert all(np.array_equal(x["layers"], y["layers"]) and x["tokens"] == y["tokens"] for x, y in zip(a, b))
    ds = ElmoDataset("s3://bucket/elmo", labels={"1": "a", "3": "b"}, storage_options=so)
    assert sorted((r["id"], r["label"]) for r in ds) == [("s.txt:1#0", "a"), ("s.txt:3#0", "b")]
    assert sorted(r["id"] for r in ElmoIterableDataset("s3://bucket/elmo", storage_options=so)) == \
        ["s.txt:1#0", "s.txt:2#0", "s.txt:3#0"]
    assert to_arrow_table("s3://bucket/elmo", ["id"], storage_options=so).column("id").to_pylist() == \
        [r["id"] for r in local.sentences()]
