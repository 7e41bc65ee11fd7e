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


def test_object_keys_are_taken_as_they_are(s3, tiny_model_files):
    """An object's key is a name, not a path: s3://b/k//a.txt, s3://b/k/a.txt and s3://b/k/x/../b.txt are distinct
    objects. Named, each is the one read (never its 'normalised' neighbour); matched by one glob, each is read
    once with an id of its own (no two documents share an id, which jammed the run)."""
    import boto3
    import pyarrow.parquet as pq
    endpoint, fs = s3
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    texts = {"keys/a.txt": "plain a here", "keys//a.txt": "double slash object", "keys/b.txt": "plain b here",
             "keys/x/../b.txt": "dot dot object"}
    for key, text in texts.items():
        client.put_object(Bucket="bucket", Key=key, Body=(text + "\n").encode())
    so = ["--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing",
          "--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1], "--torch-threads", "1",
          "--progress", "off", "--tokenizer", "whitespace"]

    def rows(out):
        fs.invalidate_cache()
        m = json.loads(fs.cat(f"bucket/{out}/manifest.json"))
        got = {}
        for s in m["shards"]:
            with fs.open(f"bucket/{out}/{s['parquet']}", "rb") as f:
                t = pq.read_table(f, columns=["id", "tokens"])
            got.update(zip(t.column("id").to_pylist(), (" ".join(x) for x in t.column("tokens").to_pylist())))
        return got
    for key in ("keys//a.txt", "keys/x/../b.txt"):
        out = "one" + str(len(key))
        run(["--input", f"s3://bucket/{key}", "--output", f"s3://bucket/{out}", *so])
        assert list(rows(out).values()) == [texts[key]]
    run(["--input", "s3://bucket/keys/**", "--output", "s3://bucket/all", *so])
    got = rows("all")
    assert sorted(got.values()) == sorted(texts.values()) and len(got) == 4


def test_an_input_replaced_after_planning_is_input_changed(s3, tmp_path):
    """The read element's check asks the store, not the listing cached while planning: an object replaced since is
    InputChanged (exit 65, docs/failure-behaviour.md), not s3fs's FileExpired from the read's If-Match (exit 75)."""
    import s3fs

    from elmo_pipeline.fsio import expand
    from elmo_pipeline.output.state import input_fingerprints
    from elmo_pipeline.pipeline.exits import classify
    from elmo_pipeline.transforms.read_step import InputChanged, check_unchanged
    endpoint, fs = s3
    so = {"s3": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}}
    fs.pipe("bucket/changing/a.txt", b"one two three\n")
    (url,) = expand(["s3://bucket/changing/*.txt"], so)         # the listing, cached by this process's filesystem
    planned = input_fingerprints([url], so)[0][1:]
    other = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint, skip_instance_cache=True)
    other.pipe("bucket/changing/a.txt", b"FOUR FIVE SIX SEVEN\n")
    with pytest.raises(InputChanged) as e:
        check_unchanged(url, planned, so)
    assert classify(e.value).status == 65



def test_folder_markers_are_no_files(s3, tiny_model_files):
    """An --output made as a folder on the S3 console (a zero-byte 'out/' marker object, 'out/parquet/' too) is an
    empty folder: the run writes there (it was refused as holding foreign files, --overwrite or not), leaves the
    markers as they are, and the output reads back."""
    import boto3

    from elmo_pipeline.downstream import ElmoOutput
    endpoint, fs = s3
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    fs.pipe("bucket/marked-in/docs.txt", (DOC + "\n").encode())
    for key in ("marked/", "marked/parquet/"):
        client.put_object(Bucket="bucket", Key=key, Body=b"")
    run(["--input", "s3://bucket/marked-in/*.txt", "--output", "s3://bucket/marked", "--progress", "off",
         "--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1], "--torch-threads", "1",
         "--s3_endpoint_url", endpoint, "--s3_access_key_id", "testing", "--s3_secret_access_key", "testing"])
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="bucket", Prefix="marked/")["Contents"]}
    assert {"marked/", "marked/parquet/", "marked/_SUCCESS"} <= keys
    out = ElmoOutput("s3://bucket/marked", {"key": "testing", "secret": "testing", "endpoint_url": endpoint})
    out.validate()
    assert out.num_sentences == 2


def test_a_create_only_put_never_replaces_an_object(s3):
    """fsio.atomic_write(create=True) on S3 (a conditional PUT, If-None-Match: *), as Finalize writes manifest.json
    and _SUCCESS: an object placed there first stays; the same bytes there (the PUT's own retry) are no conflict."""
    from elmo_pipeline.fsio import atomic_write
    _, fs = s3
    fs.pipe("bucket/create/placed", b"someone else's")
    with pytest.raises(FileExistsError):
        atomic_write(fs, "bucket/create/placed", b"ours", create=True)
    assert fs.cat("bucket/create/placed") == b"someone else's"
    atomic_write(fs, "bucket/create/new", b"ours", create=True)
    atomic_write(fs, "bucket/create/new", b"ours", create=True)          # a retry of a PUT that went through
    assert fs.cat("bucket/create/new") == b"ours"
    atomic_write(fs, "bucket/create/_SUCCESS", b"", create=True)
    atomic_write(fs, "bucket/create/_SUCCESS", b"", create=True)         # empty, as _SUCCESS: the same
    with pytest.raises(FileExistsError):
        atomic_write(fs, "bucket/create/placed", b"", create=True)
