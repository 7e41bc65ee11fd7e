"""Models by name (model/pretrained): download through fsspec into the cache with a recorded sha256 and size,
cache hits without a request, truncated downloads and changed files as clear errors, the tokenization each
model names, and --model NAME in the pipeline, the elmo command and ElmoEmbedder.from_name.

A local HTTP server serves random weights in the published `small` shapes under the published file names
($ELMO_PIPELINE_MODELS_URL points the registry at it)."""
import glob
import json
import os

import h5py
import numpy as np
import pytest

from elmo_pipeline.model.pretrained import BASE_URL_ENV, MODELS, cache_folder, model_files, model_urls
from tests.model_server import ModelServer
from tests.pipeline_helpers import parquet_rows
from elmo_pipeline.tokenization import resolve_tokenizer, tokenize_text

TEXT = "The High-Speed train left at 9 a.m. from the well-known station."


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    from elmo_pipeline.model.synthetic import write_random_bilm
    options, weights = write_random_bilm("small", str(tmp_path_factory.mktemp("small")), seed=3)
    return open(options, "rb").read(), open(weights, "rb").read()


@pytest.fixture
def server(small_files, tmp_path, monkeypatch):
    """The server with `small` published under its AllenNLP names; a fresh cache folder per test."""
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))
    with ModelServer() as srv:
        monkeypatch.setenv(BASE_URL_ENV, srv.url + "/models/elmo")
        urls = model_urls("small")
        for kind, data in zip(("options", "weights"), small_files):
            srv.files[urls[kind][len(srv.url):]] = data
        yield srv


def test_registry_lists_the_published_models_and_their_tokenization():
    assert {"wikitext2-small", "small", "medium", "original", "original-5.5B"} <= set(MODELS)
    assert MODELS["wikitext2-small"].tokenization == "wikitext"
    assert {MODELS[n].tokenization for n in ("small", "medium", "original", "original-5.5B")} == {"moses"}
    assert model_urls("original-5.5B")["weights"].endswith(
        "/2x4096_512_2048cnn_2xhighway_5.5B/elmo_2x4096_512_2048cnn_2xhighway_5.5B_weights.hdf5")


def test_unknown_name_is_a_clear_error():
    from elmo_pipeline.model.embedder import ElmoEmbedder
    with pytest.raises(ValueError, match="no model named 'nope'; known: wikitext2-small, small"):
        ElmoEmbedder.from_name("nope")


def test_raw_follows_the_model_and_keeps_the_shipped_output():
    wikitext = tokenize_text(TEXT, resolve_tokenizer("raw", "wikitext"))
    assert wikitext == tokenize_text(TEXT) == tokenize_text(TEXT, "raw")      # today's raw, unchanged
    assert ["High", "@-@", "Speed"] == wikitext[0][1:4]
    moses = tokenize_text(TEXT, resolve_tokenizer("raw", "moses"))
    assert "High-Speed" in moses[0] and "well-known" in moses[0] and "@-@" not in moses[0]
    assert resolve_tokenizer("wikitext", "moses") == "wikitext"              # an explicit choice wins
    assert resolve_tokenizer("raw", None) == "wikitext"                      # custom files: as before
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        resolve_tokenizer("spacy")


@pytest.mark.slow
def test_download_records_then_cache_hit_makes_no_request(server, small_files):
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.fsio import file_sha256, pinned_record
    options, weights, vocab = model_files("small")
    assert vocab is None and weights.startswith(cache_folder("small"))
    assert open(weights, "rb").read() == small_files[1]
    record = pinned_record(weights)
    assert record == {"url": model_urls("small")["weights"], "sha256": file_sha256(weights), "size": len(small_files[1])}
    assert server.gets("_weights.hdf5") == 1 and server.gets("_options.json") == 1
    before = len(server.requests)
    emb = ElmoEmbedder.from_name("small")                      # cache hit: verified, nothing requested
    assert len(server.requests) == before
    assert (emb.model_name, emb.tokenization, emb.output_dim) == ("small", "moses", 256)
    tokens = tokenize_text(TEXT, emb.tokenization)[0]
    np.testing.assert_array_equal(emb.embed_sentence(tokens), ElmoEmbedder(options, weights).embed_sentence(tokens))


@pytest.mark.slow
def test_truncated_download_is_an_error_and_leaves_nothing_in_the_cache(server):
    server.truncate.add(model_urls("small")["weights"][len(server.url):])
    with pytest.raises(OSError, match=r"_weights\.hdf5: download (truncated|failed)"):
        model_files("small")
    folder = cache_folder("small")
    assert not os.path.exists(os.path.join(folder, "weights.hdf5"))
    assert not glob.glob(os.path.join(folder, "*.tmp-*")) and not glob.glob(os.path.join(folder, "weights*.json"))
    server.truncate.clear()                                    # the next try downloads it whole
    assert os.path.getsize(model_files("small")[1]) == len(server.files[model_urls("small")["weights"][len(server.url):]])


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (lambda b: b[:-10], r"size differs from its first download \(recorded \d+ bytes, found \d+\)"),
    (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], r"sha256 differs from its first download \(recorded [0-9a-f]{64}, found"),
])
def test_changed_cached_file_names_the_file_and_what_differs(server, change, message):
    weights = model_files("small")[1]
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(change(data))
    with pytest.raises(ValueError, match=f"{weights}: {message}"):
        model_files("small")


@pytest.mark.slow
def test_remote_file_changed_after_the_first_download(server):
    weights = model_files("small")[1]
    os.remove(weights)                                         # the cache lost the file, the record stays
    path = model_urls("small")["weights"][len(server.url):]
    server.files[path] = server.files[path][:-1] + b"x"
    with pytest.raises(ValueError, match="differs from the one first recorded"):
        model_files("small")
    assert not os.path.exists(weights) and not glob.glob(weights + ".tmp-*")


@pytest.mark.slow
def test_pipeline_elmo_command_and_models_command_by_name(server, tmp_path, capsys):
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.pipeline.cli import main as cli
    from elmo_pipeline.pipeline.run import run
    from elmo_pipeline.fsio import pinned_record
    inp = tmp_path / "in.txt"
    inp.write_text(TEXT + "\n")
    out = str(tmp_path / "out")
    run(["--input", str(inp), "--output", out, "--model", "small", "--format", "parquet", "--torch-threads", "1",
         "--progress", "off"])
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    weights = os.path.join(cache_folder("small"), "weights.hdf5")
    m = manifest["model"]
    assert (m["name"], m["tokenization"], m["tokenizer"]) == ("small", "moses", "moses")
    assert m["weights_sha256"] == pinned_record(weights)["sha256"] and m["urls"] == model_urls("small")
    (row,) = parquet_rows(out, manifest).values()
    assert "High-Speed" in row["tokens"]
    out2 = str(tmp_path / "out2")                             # an explicit --tokenizer overrides the model's
    run(["--input", str(inp), "--output", out2, "--model", "small", "--format", "parquet", "--torch-threads", "1",
         "--progress", "off", "--tokenizer", "wikitext"])
    manifest2 = json.load(open(os.path.join(out2, "manifest.json")))
    assert manifest2["model"]["tokenizer"] == manifest2["tokenizer"] == "wikitext"
    (row,) = parquet_rows(out2, manifest2).values()
    assert row["tokens"][1:4] == ["High", "@-@", "Speed"]
    assert server.gets("_weights.hdf5") == 1

    lines = tmp_path / "lines.txt"
    lines.write_text("High-Speed trains .\n")
    h5 = str(tmp_path / "e.hdf5")
    assert cli(["elmo", str(lines), h5, "--all", "--model", "small"]) == 0
    with h5py.File(h5) as f:
        np.testing.assert_array_equal(f["0"][()], ElmoEmbedder.from_name("small").embed_sentence(["High-Speed", "trains", "."]))
    assert server.gets("_weights.hdf5") == 1                  # every use after the first: the cache

    capsys.readouterr()
    assert cli(["models"]) == 0
    table = capsys.readouterr().out
    small = next(line for line in table.splitlines() if line.startswith("small "))
    assert "cached" in small and "256" in small and "13.6M" in small and "moses" in small
    assert "not downloaded" in next(line for line in table.splitlines() if line.startswith("medium "))


def test_a_worker_elsewhere_gets_the_named_model_and_checks_it(tmp_path):
    """A ModelSpec names its model: where the launcher's paths do not exist (a remote worker), the worker takes
    its own copy from model.pretrained and checks it against the sha256 the run was planned with."""
    from elmo_pipeline.fsio import file_sha256
    from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
    from elmo_pipeline.model.resolve import ModelSpec
    options, weights, _ = model_files(DEFAULT_MODEL)
    sha = file_sha256(weights)
    here = ModelSpec(options, weights, model_name=DEFAULT_MODEL, weights_sha256=sha)
    assert here.local_files()[:2] == (options, weights)
    gone = str(tmp_path / "launcher-only")
    elsewhere = ModelSpec(gone + "/options.json", gone + "/weights.hdf5", model_name=DEFAULT_MODEL, weights_sha256=sha)
    assert elsewhere.local_files()[:2] == (options, weights)
    other = ModelSpec(gone + "/options.json", gone + "/weights.hdf5", model_name=DEFAULT_MODEL, weights_sha256="0" * 64)
    with pytest.raises(ValueError, match="not the one the run was planned with"):
        other.local_files()
    with pytest.raises(FileNotFoundError):
        ModelSpec(gone + "/options.json", gone + "/weights.hdf5").local_files()     # custom files: no fallback
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\nthe\n")
    given = ModelSpec(gone + "/options.json", gone + "/weights.hdf5", vocab_file=str(vocab), model_name=DEFAULT_MODEL,
                      weights_sha256=sha)
    assert given.local_files() == (options, weights, str(vocab))        # a --vocab-file readable here is kept


def test_a_damaged_download_record_is_refused_naming_it(tmp_path):
    """The record pinning a download's first sha256 is read back checked: damaged (not JSON, another kind, a
    size or digest of the wrong kind), it is one ValueError naming it, and neither it nor the file is replaced."""
    from elmo_pipeline.fsio import pinned_download, pinned_record
    src = tmp_path / "weights.hdf5"
    src.write_bytes(b"weights" * 100)
    dst = str(tmp_path / "cache" / "weights.hdf5")
    assert pinned_download(str(src), dst, progress=False) == dst and pinned_record(dst)["size"] == 700
    for text in ("{", "[1]", '{"size": "700", "sha256": "ab"}', '{"size": 700}'):
        with open(dst + ".sha256.json", "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=r"weights\.hdf5\.sha256\.json: a damaged download record"):
            pinned_download(str(src), dst, progress=False)
        assert open(dst + ".sha256.json").read() == text and os.path.getsize(dst) == 700


def test_a_killed_downloads_part_is_removed_by_the_next_download_and_a_live_ones_left(tmp_path):
    """A download SIGKILLed mid-stream (`models --download`, --model NAME) left its part, `weights.hdf5.tmp-<hex>`,
    in the cache for good: each kill up to the weights' size more. The next download removes such parts, never one a
    live download holds (fsio.held_temp's flock: two commands may fetch one model at once)."""
    from elmo_pipeline.fsio import held_temp, pinned_download, temp_name
    src = tmp_path / "weights.hdf5"
    src.write_bytes(b"weights" * 100)
    dst = str(tmp_path / "cache" / "weights.hdf5")
    os.makedirs(os.path.dirname(dst))
    killed = temp_name(dst)
    with open(killed, "wb") as f:
        f.write(b"w" * 300)                     # what a killed download leaves: no process holds it
    with held_temp(dst) as live:
        assert pinned_download(str(src), dst, progress=False) == dst and os.path.getsize(dst) == 700
        assert not os.path.exists(killed) and os.path.exists(live)
    assert sorted(os.listdir(os.path.dirname(dst))) == ["weights.hdf5", "weights.hdf5.sha256.json"]


def _cached_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def test_an_options_file_larger_than_options_may_be_is_never_fetched_whole(server, tmp_path):
    """A mirror answering a published model's options.json, or an --options-file URL, with a large body (a wrong
    file, an endless stream): it was fetched whole into the cache (100 MB by a slow server: until the disk filled)
    before the options' bounded read (OPTIONS_MAX_BYTES) refused it (`elmo`, `plan`, `run`). The download stops at
    the bound (here: at the size the server announces, before the body), and a remote options file is read as it
    comes, within the bound, before any copy is cached."""
    from elmo_pipeline.model.options import OPTIONS_MAX_BYTES, OptionsError, load_options
    big = b" " * (2 * OPTIONS_MAX_BYTES)
    server.files[model_urls("small")["options"][len(server.url):]] = big
    with pytest.raises(OSError, match=r"_options\.json: \d+ bytes, larger than the 1048576 such a file may have"):
        model_files("small")
    assert _cached_bytes(tmp_path / "cache") == 0
    server.files["/options.json"] = big
    with pytest.raises(OptionsError, match="larger than 1048576 bytes"):
        load_options(server.url + "/options.json")
    assert _cached_bytes(tmp_path / "cache") == 0
    from elmo_pipeline.model.resolve import fetch_model_files      # `run` and `plan`: the model's local copies
    with pytest.raises(OptionsError, match="larger than 1048576 bytes"):
        fetch_model_files(server.url + "/options.json", server.url + "/weights.hdf5")
    assert _cached_bytes(tmp_path / "cache") == 0


def test_a_published_weights_file_larger_than_its_parameters_is_never_fetched_whole(server, tmp_path, monkeypatch):
    """A published model's weights download stops at what its parameters can take (float64, and slack:
    weights_max_bytes, 168 MiB for `small`): a mirror's endless answer filled the disk. Here the bound is made
    smaller than the served file; the options, within theirs, are kept."""
    import elmo_pipeline.model.pretrained as pretrained
    assert 60 << 20 < pretrained.weights_max_bytes("small") < 200 << 20
    monkeypatch.setattr(pretrained, "weights_max_bytes", lambda name: 1000)
    with pytest.raises(OSError, match=r"_weights\.hdf5: \d+ bytes, larger than the 1000 such a file may have"):
        model_files("small")
    assert sorted(os.listdir(cache_folder("small"))) == ["options.json", "options.json.sha256.json"]


def test_a_remote_files_secret_is_written_to_no_file_of_the_cache(tmp_path, monkeypatch, tiny_model_files):
    """A presigned or password-carrying URL (--weight-file, INPUT_FILE): fsspec's file cache wrote the whole URL,
    password, signature and fragment, into its metadata file (<cache>/cache) for good. Such a URL is now fetched
    into a folder named by its digest, and no file under the cache holds the secret; a second read is a cache hit."""
    from elmo_pipeline.fsio import local_path, open_url
    monkeypatch.setenv("ELMO_PIPELINE_CACHE", str(tmp_path / "cache"))
    secret = "?X-Amz-Signature=SIGSECRET&X-Amz-Credential=CREDSECRET#FRAGSECRET"
    with ModelServer() as srv:
        srv.files["/w.hdf5"] = open(tiny_model_files[1], "rb").read()
        srv.files["/in.txt"] = b"the cat sat\n"
        base = srv.url.replace("http://", "http://alice:PWSECRET@")
        weights = local_path(base + "/w.hdf5" + secret)
        assert open(weights, "rb").read() == srv.files["/w.hdf5"]
        with open_url(base + "/in.txt" + secret) as f:
            assert f.read() == b"the cat sat\n"
        gets = srv.gets()
        assert local_path(base + "/w.hdf5" + secret) == weights and srv.gets() == gets
    for folder, _, names in os.walk(tmp_path / "cache"):
        for name in names:
            data = open(os.path.join(folder, name), "rb").read()
            assert not any(s in data or s in name.encode() for s in (b"PWSECRET", b"SIGSECRET", b"CREDSECRET",
                                                                        b"FRAGSECRET")), name


def test_a_download_of_no_announced_size_stops_at_its_bound(tmp_path, monkeypatch):
    """pinned_download's max_bytes where the store announces no size (a chunked answer): the stream stops one block
    past the bound, an OSError, and nothing is left in the cache."""
    from fsspec.implementations.local import LocalFileSystem
    from elmo_pipeline.fsio import pinned_download

    def no_size(self, path):
        raise NotImplementedError
    monkeypatch.setattr(LocalFileSystem, "size", no_size)
    src = tmp_path / "weights.hdf5"
    src.write_bytes(b"w" * (3 << 20))
    dst = str(tmp_path / "cache" / "weights.hdf5")
    with pytest.raises(OSError, match=r"larger than the 1000 bytes such a file may have: not fetched"):
        pinned_download(str(src), dst, progress=False, max_bytes=1000)
    assert os.listdir(tmp_path / "cache") == []
