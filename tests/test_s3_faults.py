"""Input and output on an S3 API (moto's server on 127.0.0.1) that answers one request in ten with
503 SlowDown or 500 InternalError; the run is also SIGKILLed half-way and rerun. The retried requests and
the resumed run give exactly what a local run gives."""
import logging
import os
import random

import pytest

from elmo_pipeline.pipeline.run import main
from tests.flaky_s3 import FlakyS3
from tests.resume_helpers import argv, assert_same_output, read_output, run_subprocess, write_corpus

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes

OPTS = ("--shard-sentences", "8", "--max-tokens-per-batch", "256")


@pytest.fixture(scope="module")
def flaky_s3():
    pytest.importorskip("moto.server")
    s3 = FlakyS3(rate=0.1, seed=5).start()     # each fault costs a retry's backoff (sleep): ~40 in the first test
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    yield s3
    import s3fs      # moto's backend is global to the process: leave no bucket behind for other tests
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3.endpoint)
    for bucket in ("elmo-flaky-1", "elmo-flaky-2", "elmo-flaky-3"):
        if fs.exists(bucket):
            fs.rm(bucket, recursive=True)
    s3.stop()


def test_flaky_s3_with_a_crash_equals_local(flaky_s3, tiny_model_files, tmp_path, capsys, monkeypatch):
    """Input, output and the model files on the flaky store (the model downloads retry as the data path)."""
    import s3fs
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=flaky_s3.endpoint)
    corpus = write_corpus(str(tmp_path / "docs.txt"))
    fs.mkdir("elmo-flaky-1")
    fs.put_file(corpus, "elmo-flaky-1/in/docs.txt")
    s3_model = []
    for f in tiny_model_files:
        fs.put_file(f, "elmo-flaky-1/model/" + os.path.basename(f))
        s3_model.append("s3://elmo-flaky-1/model/" + os.path.basename(f))
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))     # a real download, in every process
    ref_out = str(tmp_path / "local")
    assert main(argv(tiny_model_files, corpus, ref_out, *OPTS)) == 0
    reference = read_output(ref_out)

    s3_args = argv(s3_model, "s3://elmo-flaky-1/in/*.txt", "s3://elmo-flaky-1/out", *OPTS,
                   "--s3_endpoint_url", flaky_s3.endpoint, "--s3_access_key_id", "testing",
                   "--s3_secret_access_key", "testing")
    flaky_s3.faults.enabled = True
    try:
        p = run_subprocess(s3_args, "embed:3")       # killed half-way (a shard committed), on the flaky store
        assert p.returncode == -9, p.stderr[-3000:]
        fs.invalidate_cache()
        assert fs.find("elmo-flaky-1/out/_staging") and not fs.exists("elmo-flaky-1/out/_SUCCESS")
        assert main(s3_args) == 0, capsys.readouterr().err[-3000:]    # the same command resumes and finishes
    finally:
        flaky_s3.faults.enabled = False
    injected = flaky_s3.faults.injected
    got = read_output("s3://elmo-flaky-1/out", fs)
    assert_same_output(got, reference)
    assert got[0]["run"]["resumed_sentences"] > 0
    assert len(os.listdir(tmp_path / "cache")) >= 2         # the model files came from the store
    methods = {m for _, m in injected}
    assert sum(injected.values()) >= 10 and {"GET", "PUT", "HEAD"} <= methods, injected
    assert {c for c, _ in injected} == {"SlowDown", "InternalError"}
    print(f"injected {sum(injected.values())} errors in {flaky_s3.faults.requests} requests: {dict(injected)}")


def test_s3_max_attempts_reaches_botocore(flaky_s3, tiny_model_files, tmp_path):
    """With --s3-max-attempts 1 nothing retries a 500 (s3fs itself retries only SlowDown): the same
    flaky store now fails the run, which shows the setting is what made the test above pass."""
    import s3fs
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=flaky_s3.endpoint)
    corpus = write_corpus(str(tmp_path / "docs.txt"), n_docs=4)
    fs.mkdir("elmo-flaky-2")
    fs.put_file(corpus, "elmo-flaky-2/in/docs.txt")
    args = argv(tiny_model_files, "s3://elmo-flaky-2/in/docs.txt", "s3://elmo-flaky-2/out", *OPTS,
                "--s3-max-attempts", "1",
                "--s3_endpoint_url", flaky_s3.endpoint, "--s3_access_key_id", "testing",
                "--s3_secret_access_key", "testing")
    flaky_s3.faults.enabled, rate = True, flaky_s3.faults.rate
    flaky_s3.faults.rate = 0.5
    try:
        try:
            rc = main(args)
        except Exception as e:  # noqa: BLE001 - the injected error, surfacing
            rc = repr(e)
    finally:
        flaky_s3.faults.enabled, flaky_s3.faults.rate = False, rate
    assert rc != 0        # e.g. OSError(16, 'Service Unavailable'): a 503 on a HEAD has no SlowDown body
    fs.invalidate_cache()
    assert not fs.exists("elmo-flaky-2/out/_SUCCESS")


def test_model_downloads_take_the_s3_retry_options(flaky_s3, tiny_model_files, tmp_path, monkeypatch):
    """Model files are fetched with the run's storage options: 10 attempts get through a store failing half
    of its requests; 1 attempt does not."""
    import s3fs

    from elmo_pipeline.model.resolve import fetch_model_files
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=flaky_s3.endpoint)
    fs.mkdir("elmo-flaky-3")
    urls = []
    for f in tiny_model_files:
        fs.put_file(f, "elmo-flaky-3/" + os.path.basename(f))
        urls.append("s3://elmo-flaky-3/" + os.path.basename(f))

    def fetch(attempts, cache):
        monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / cache))
        so = {"s3": {"endpoint_url": flaky_s3.endpoint, "key": "testing", "secret": "testing",
                     "config_kwargs": {"retries": {"total_max_attempts": attempts, "mode": "standard"}}}}
        return fetch_model_files(urls[0], urls[1], None, so)
    flaky_s3.faults.enabled, rate = True, flaky_s3.faults.rate
    flaky_s3.faults.rate = 0.3                  # faults enough to need retries, few backoffs in a row
    try:
        flaky_s3.faults.rng, before = random.Random(1), sum(flaky_s3.faults.injected.values())
        got = fetch(10, "c10")                  # its first request faults (the first draw, 0.13): retried
        assert sum(flaky_s3.faults.injected.values()) > before
        flaky_s3.faults.rng = random.Random(1)  # its first draw (0.13) faults: the first request fails, whatever
        with pytest.raises(Exception):        # noqa: B017 - whichever error the first injected fault gives
            fetch(1, "c1")                    # ran before in this module (the injector is shared)
    finally:
        flaky_s3.faults.enabled, flaky_s3.faults.rate = False, rate
    for local, original in zip(got, tiny_model_files):
        assert open(local, "rb").read() == open(original, "rb").read()
