"""Weights from an object store: s3:// through fsspec against moto's S3 server on 127.0.0.1."""
import socket

import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder, load_bilm

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_endpoint(monkeypatch, tmp_path):
    server_mod = pytest.importorskip("moto.server")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": url,
                 "AWS_DEFAULT_REGION": "us-east-1", "ELMO_PIPELINE_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    yield url
    server.stop()


def test_load_from_s3_with_cache(tiny_model_files, s3_endpoint, tmp_path):
    import s3fs
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir("models")
    options, weights = tiny_model_files
    fs.put(options, "models/tiny/options.json")
    fs.put(weights, "models/tiny/weights.hdf5")
    remote = ElmoEmbedder("s3://models/tiny/options.json", "s3://models/tiny/weights.hdf5")
    local = ElmoEmbedder(options, weights)
    sent = ["weights", "from", "an", "object", "store"]
    np.testing.assert_array_equal(remote.embed_sentence(sent), local.embed_sentence(sent))
    assert list((tmp_path / "cache").iterdir()), "remote weights should be cached locally"
    # a second load is served from the cache even when the object is gone
    fs.rm("models/tiny/weights.hdf5")
    load_bilm("s3://models/tiny/options.json", "s3://models/tiny/weights.hdf5")
