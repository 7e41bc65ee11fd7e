"""downstream readers over an object store: a real pipeline output uploaded to moto's S3 server on loopback."""
import json
import os

import numpy as np
import pytest

from elmo_pipeline.downstream import ElmoDataset, ElmoIterableDataset, ElmoOutput, to_arrow_table
from tests.pipeline_helpers import moto_s3, run_pipeline

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes


@pytest.fixture(scope="module")
def s3():
    with moto_s3("downstream") as endpoint_fs:
        yield endpoint_fs


def test_readers_on_s3(s3, tmp_path, tiny_model_files):
    endpoint, fs = s3
    (tmp_path / "s.txt").write_text("the first line\nand a second one\nthird\n")
    out = str(tmp_path / "out")
    _, manifest = run_pipeline(tiny_model_files, str(tmp_path / "s.txt"), out, "--input-format", "lines",
                               "--tokenizer", "whitespace", "--shard-sentences", "2")
    for root, _, files in os.walk(out):
        for name in files:
            local = os.path.join(root, name)
            fs.put_file(local, "downstream/elmo/" + os.path.relpath(local, out))
    so = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    remote, local = ElmoOutput("s3://downstream/elmo", so), ElmoOutput(out)
    assert remote.manifest == json.load(open(os.path.join(out, "manifest.json")))
    for fmt in ("parquet", "hdf5"):
        a, b = list(remote.sentences(fmt)), list(local.sentences(fmt))
        assert [r["id"] for r in a] == [r["id"] for r in b]
        assert sorted(r["id"] for r in a) == ["s.txt:1#0", "s.txt:2#0", "s.txt:3#0"]
        assert all(np.array_equal(x["layers"], y["layers"]) and x["tokens"] == y["tokens"] for x, y in zip(a, b))
    ds = ElmoDataset("s3://downstream/elmo", labels={"1": "a", "3": "b"}, storage_options=so)
    assert sorted((r["id"], r["label"]) for r in ds) == [("s.txt:1#0", "a"), ("s.txt:3#0", "b")]
    assert sorted(r["id"] for r in ElmoIterableDataset("s3://downstream/elmo", storage_options=so)) == \
        ["s.txt:1#0", "s.txt:2#0", "s.txt:3#0"]
    assert to_arrow_table("s3://downstream/elmo", ["id"], storage_options=so).column("id").to_pylist() == \
        [r["id"] for r in local.sentences()]
