"""Model files validated before any allocation: options.json against its schema (model/options.py BOUNDS: types,
bounds from the published biLMs), and the weights' shapes read from the HDF5 metadata before a tensor is built
(model/weights.py check_weights_match). Unit tests of the schema, Hypothesis fuzzing of the parser, and real
`python -m elmo_pipeline.pipeline.run` processes given the options that once allocated gigabytes or failed with a raw error."""
import copy
import json
import os
import subprocess
import sys

import h5py
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.options import BOUNDS, OPTIONS_MAX_BYTES, OptionsError, load_options, parse_options
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
from elmo_pipeline.model.weights import WeightsError, load_bilm, save_bilm, weight_shapes
from elmo_pipeline.training.train import default_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "model", "pretrained", "wikitext2-small")
FIXTURE_OPTIONS = os.path.join(os.path.dirname(REPO), "shared", "fixtures", "bilm-tf", "options.json")


def _shipped() -> dict:
    with open(os.path.join(SHIPPED, "options.json")) as f:
        return json.load(f)


def _known_options() -> dict[str, dict]:
    """Every options dict the project ships, publishes or writes: they must all pass the schema."""
    known = {name: copy.deepcopy(o) for name, o in PUBLISHED_OPTIONS.items()}
    known["wikitext2-small"] = _shipped()
    known["train-char"] = {**default_options("char"), "n_tokens_vocab": 33280}
    known["train-word-1b"] = {**default_options("word"), "n_tokens_vocab": 793471}
    if os.path.isfile(FIXTURE_OPTIONS):
        with open(FIXTURE_OPTIONS) as f:
            known["bilm-tf-fixture"] = json.load(f)
    return known


def _meta_parameters(opts) -> int:
    """What BiLM(opts) allocates, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in BiLM(opts).parameters())


def _refused(raw, *words: str) -> str:
    with pytest.raises(OptionsError) as e:
        parse_options(raw)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def _edited(edit) -> dict:
    raw = copy.deepcopy(PUBLISHED_OPTIONS["original"])
    edit(raw)
    return raw


# ---------------------------------------------------------------- the schema (fast)
@pytest.mark.parametrize("name", sorted(_known_options()))
def test_every_known_model_passes_and_its_parameter_count_is_what_bilm_allocates(name):
    opts = parse_options(_known_options()[name])
    assert opts.n_parameters == _meta_parameters(opts) <= BOUNDS["parameters"].largest


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_weight_shapes_are_the_datasets_save_bilm_writes(name, tmp_path):
    from elmo_pipeline.model.synthetic import random_bilm
    model = random_bilm(name)
    save_bilm(model, str(tmp_path / "o.json"), str(tmp_path / "w.hdf5"))
    written = {}
    with h5py.File(tmp_path / "w.hdf5") as f:
        f.visititems(lambda n, ds: written.__setitem__(n, ds.shape) if isinstance(ds, h5py.Dataset) else None)
    assert written == {n: shape for n, (shape, _) in weight_shapes(model.opts).items()}


@pytest.mark.parametrize("edit, words", [
    (lambda r: r["lstm"].__setitem__("n_layers", 1.7), ["'lstm.n_layers'", "should be an integer", "1.7"]),
    (lambda r: r["lstm"].__setitem__("n_layers", 2.0), ["'lstm.n_layers'", "should be an integer", "2.0"]),
    (lambda r: r["lstm"].__setitem__("n_layers", True), ["'lstm.n_layers'", "should be an integer"]),
    (lambda r: r["lstm"].__setitem__("dim", "4096"), ["'lstm.dim'", "should be an integer"]),
    (lambda r: r["lstm"].__setitem__("dim", 16385), ["'lstm.dim' = 16385", "above the largest allowed 16384"]),
    (lambda r: r["lstm"].__setitem__("projection_dim", 0), ["'lstm.projection_dim' = 0", "below the smallest"]),
    (lambda r: r["lstm"].__setitem__("n_layers", 17), ["'lstm.n_layers' = 17", "largest allowed 16"]),
    (lambda r: r["lstm"].__setitem__("cell_clip", float("nan")), ["'lstm.cell_clip'", "finite"]),
    (lambda r: r["lstm"].__setitem__("proj_clip", -3), ["'lstm.proj_clip' = -3", "below the smallest"]),
    (lambda r: r["lstm"].__setitem__("cell_clip", "3"), ["'lstm.cell_clip'", "a number or null"]),
    (lambda r: r["lstm"].__setitem__("use_skip_connections", 1), ["'lstm.use_skip_connections'", "true or false"]),
    (lambda r: r.__setitem__("lstm", [2, 4096]), ["'lstm' should be an object"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 1000000]]),
     ["'char_cnn.filters[0][1]' = 1000000", "above the largest allowed 16384"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, -5]]), ["'char_cnn.filters[0][1]' = -5", "below"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[0, 5]]), ["'char_cnn.filters[0][0]' = 0", "below"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 5.0]]), ["'char_cnn.filters[0][1]'", "an integer"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 5, 7]]), ["'char_cnn.filters'", "[0] is [1, 5, 7]"]),
    (lambda r: r["char_cnn"].__setitem__("filters", []), ["'char_cnn.filters' has 0 pairs", "below"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 1]] * 33), ["'char_cnn.filters' has 33 pairs", "above"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 9000], [2, 9000]]),
     ["'char_cnn.filters' counts add up to 18000", "above the largest allowed 16384"]),
    (lambda r: r["char_cnn"].__setitem__("embedding", {"dim": 65}), ["'char_cnn.embedding.dim' = 65", "above"]),
    (lambda r: r["char_cnn"].__setitem__("embedding", 16), ["'char_cnn.embedding' should be an object"]),
    (lambda r: r["char_cnn"].__setitem__("n_highway", 9), ["'char_cnn.n_highway' = 9", "above"]),
    (lambda r: r["char_cnn"].__setitem__("n_characters", 262.0), ["'char_cnn.n_characters'", "261, 262"]),
    (lambda r: r["char_cnn"].__setitem__("max_characters_per_token", 257), ["'char_cnn.max_characters_per_token'"]),
    (lambda r: r["char_cnn"].__setitem__("max_characters_per_token", 5), ["smaller than the widest filter (7)"]),
    (lambda r: r.__setitem__("char_cnn", [1]), ["'char_cnn' should be an object"]),
    (lambda r: r.__setitem__("n_tokens_vocab", 4_194_305), ["'n_tokens_vocab' = 4194305", "above"]),
    (lambda r: r["lstm"].__setitem__("cell_clip", 10 ** 5000), ["'lstm.cell_clip'", "above the largest"]),
])
def test_a_bad_value_is_refused_naming_its_key(edit, words):
    _refused(_edited(edit), *words)


def test_values_each_within_bounds_but_too_large_together_are_refused():
    raw = _edited(lambda r: r["char_cnn"].__setitem__("filters", [[1, 16000]]))      # 2 highways of 16000^2 x 2
    _refused(raw, "parameters", "char_cnn.filters", "above the largest allowed 536870912")
    word = {**default_options("word"), "n_tokens_vocab": 4_000_000}
    word["lstm"]["projection_dim"] = 512
    _refused(word, "parameters", "n_tokens_vocab")


def test_a_word_encoder_needs_its_vocabulary_size():
    _refused(default_options("word"), "'n_tokens_vocab' is missing")


@pytest.mark.parametrize("text, words", [
    ("[" * 100_000 + "]" * 100_000, ["not valid JSON"]),                 # nesting past the recursion limit
    ('{"lstm": {"n_layers": ' + "9" * 5000 + "}}", ["not valid JSON"]),     # an integer too long to parse
    (b"\xff\xfe\x00garbage", ["not valid JSON"]),
    (" " * (OPTIONS_MAX_BYTES + 1), ["larger than 1048576 bytes"]),
])
def test_unreadable_options_files_are_options_errors(tmp_path, text, words):
    path = tmp_path / "options.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(OptionsError) as e:
        load_options(str(path))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), e.value


# ---------------------------------------------------------------- row 8: options against the shipped weights
@pytest.mark.parametrize("edit, error, words", [
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 16000]]), WeightsError,
     ["'CNN/W_cnn_0' has shape (1, 1, 16, 32), expected (1, 1, 16, 16000)", "char_cnn.filters[0]"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, 1000000]]), OptionsError,
     ["'char_cnn.filters[0][1]' = 1000000 is above the largest allowed 16384"]),
    (lambda r: r["char_cnn"].__setitem__("filters", [[1, -5]]), OptionsError,
     ["'char_cnn.filters[0][1]' = -5 is below the smallest allowed 1"]),
    (lambda r: r["lstm"].__setitem__("n_layers", 1.7), OptionsError, ["'lstm.n_layers' should be an integer"]),
    (lambda r: r["lstm"].__setitem__("dim", 4096), WeightsError, ["expected (256, 16384)", "lstm.dim"]),
])
def test_options_that_do_not_fit_the_shipped_weights_fail_naming_the_key(tmp_path, edit, error, words):
    raw = _shipped()
    edit(raw)
    (tmp_path / "options.json").write_text(json.dumps(raw))
    with pytest.raises(error) as e:
        load_bilm(str(tmp_path / "options.json"), os.path.join(SHIPPED, "weights.hdf5"))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), e.value


# `python -m elmo_pipeline.pipeline.run ARGS` that writes its own peak resident memory (VmHWM, KiB) to PEAK_FILE at
# exit: the kernel's ru_maxrss of a child also counts the memory of the (large) test process it was forked from
RUN_AND_REPORT_PEAK = """import atexit, runpy, sys
peak_file = sys.argv[1]
def report():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM"))
    with open(peak_file, "w") as f:
        f.write(kib)
atexit.register(report)
sys.argv = ["elmo_pipeline.pipeline.run"] + sys.argv[2:]
runpy.run_module("elmo_pipeline.pipeline.run", run_name="__main__", alter_sys=True)
"""


def _run_pipeline(options: str, out: str) -> tuple[int, str, int]:
    """(exit status, stderr, the pipeline process's peak resident memory in bytes)."""
    peak_file = os.path.join(os.path.dirname(out), "peak_kib.txt")
    p = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_PEAK, peak_file, "--input", "samples/sample.txt",
                        "--output", out, "--torch-threads", "1", "--options-file", options,
                        "--weight-file", os.path.join(SHIPPED, "weights.hdf5")],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    with open(peak_file) as f:
        return p.returncode, p.stderr, int(f.read()) * 1024


@pytest.mark.slow
@pytest.mark.parametrize("case, edit, words", [
    ("16000", lambda r: r["char_cnn"].__setitem__("filters", [[1, 16000]]),
     ["WeightsError", "'CNN/W_cnn_0'", "expected (1, 1, 16, 16000)", "char_cnn.filters[0]"]),
    ("1000000", lambda r: r["char_cnn"].__setitem__("filters", [[1, 1000000]]),
     ["OptionsError", "'char_cnn.filters[0][1]' = 1000000 is above the largest allowed 16384"]),
    ("-5", lambda r: r["char_cnn"].__setitem__("filters", [[1, -5]]),
     ["OptionsError", "'char_cnn.filters[0][1]' = -5 is below the smallest allowed 1"]),
    ("1.7", lambda r: r["lstm"].__setitem__("n_layers", 1.7),
     ["OptionsError", "'lstm.n_layers' should be an integer, found 1.7"]),
])
def test_bad_options_exit_65_with_one_line_and_no_big_allocation(tmp_path, case, edit, words):
    raw = _shipped()
    edit(raw)
    options = tmp_path / "options.json"
    options.write_text(json.dumps(raw))
    out = str(tmp_path / "out")
    status, stderr, peak = _run_pipeline(str(options), out)
    assert status == 65, stderr[-3000:]
    # the 16000 filters' BiLM alone is 2.1 GB (found: 2.35 GB peak); the process without a model is ~0.4 GB
    assert peak < 1 << 30, f"peak resident memory {peak / 2**20:.0f} MiB"
    (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert all(w in line for w in words) and "(exit 65: fix the data)" in line, line
    assert "Traceback" not in stderr
    assert not os.path.exists(out)


# ---------------------------------------------------------------- fuzzing the parser
_leaves = (st.none() | st.booleans() | st.integers() | st.integers(-2, 70_000)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
_json = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
_extremes = st.sampled_from([0, -1, -5, 16_385, 1_000_000, 10 ** 30, 10 ** 5000, -(10 ** 30), 1.7, 2.0, 1e308,
                             float("nan"), float("inf"), True, "", [], {}])
@st.composite
def _shaped(draw):
    """options.json's shape with random values: each key usually present with a valid value (so that later keys
    are reached), else absent, extreme or any JSON."""
    def value(valid):
        roll = draw(st.integers(0, 19))
        return draw(valid) if roll < 16 else _MISSING if roll == 16 else draw(_extremes | _json)

    def obj(**values):
        made = {k: value(v) for k, v in values.items()}
        return {k: v for k, v in made.items() if v is not _MISSING}

    small = st.integers(1, 8)
    lstm = obj(n_layers=small, dim=small, projection_dim=small, cell_clip=st.none() | st.floats(0.001, 10),
               proj_clip=st.none() | st.integers(1, 5), use_skip_connections=st.booleans())
    pair = st.builds(lambda w, n: [w, n], st.integers(1, 7), small)
    char_cnn = obj(embedding=st.builds(lambda d: {"dim": d}, small), filters=st.lists(pair, min_size=1, max_size=4),
                   n_highway=st.integers(0, 2), n_characters=st.sampled_from([261, 262]),
                   activation=st.sampled_from(["relu", "tanh"]), max_characters_per_token=st.integers(7, 50))
    if isinstance(char_cnn.get("filters"), list) and char_cnn["filters"] and draw(st.booleans()):
        i = draw(st.integers(0, len(char_cnn["filters"]) - 1))
        char_cnn["filters"][i] = draw(_extremes | _json)      # one pair random
    return obj(lstm=st.just(lstm), char_cnn=st.none() | st.just(char_cnn), n_tokens_vocab=st.integers(1, 100))


_MISSING = object()


def _paths(value, prefix=()):
    """Every (container path, key or index) inside a JSON value."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _mutate(raw: dict, path: tuple, how: str, new) -> None:
    """Delete the value at `path`, wrap it in a list or an object, or replace it with `new`."""
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "nest in a list":
        parent[key] = [parent[key]]
    elif how == "nest in an object":
        parent[key] = {"value": parent[key]}
    else:
        parent[key] = new


def _parsed_or_refused(raw) -> None:
    """parse_options either refuses with one OptionsError line or gives options a BiLM of at most
    BOUNDS['parameters'] is built from, which round-trip through to_json."""
    try:
        opts = parse_options(raw)
    except OptionsError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 600, str(e)
        return
    assert all(type(v) is int for v in (opts.n_layers, opts.lstm_dim, opts.projection_dim))
    assert _meta_parameters(opts) <= BOUNDS["parameters"].largest
    again = parse_options(json.loads(opts.to_json()))      # compared as JSON text: NaN is not equal to itself
    assert again.to_json() == opts.to_json()
    if opts.char_cnn:
        assert again.filters == opts.filters


_fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(_json | _shaped())
def test_random_json_parses_or_is_refused_with_an_options_error(raw):
    _parsed_or_refused(raw)


@_fuzz
@given(st.data())
def test_mutated_valid_options_parse_or_are_refused_with_an_options_error(data):
    names = sorted(_known_options())
    raw = copy.deepcopy(_known_options()[data.draw(st.sampled_from(names))])
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(raw))
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        how = data.draw(st.sampled_from(["replace", "delete", "nest in a list", "nest in an object"]))
        _mutate(raw, path, how, data.draw(_extremes | _leaves | _json))
    _parsed_or_refused(raw)


_valid = st.fixed_dictionaries({
    "lstm": st.fixed_dictionaries({
        "n_layers": st.integers(1, 4), "dim": st.integers(1, 64), "projection_dim": st.integers(1, 32),
        "cell_clip": st.none() | st.floats(0.001, 100) | st.integers(1, 100),
        "proj_clip": st.none() | st.floats(0.001, 100), "use_skip_connections": st.booleans()}),
    "char_cnn": st.fixed_dictionaries({
        "embedding": st.fixed_dictionaries({"dim": st.integers(1, 8)}),
        "filters": st.lists(st.tuples(st.integers(1, 7), st.integers(1, 16)).map(list), min_size=1, max_size=5),
        "n_highway": st.integers(0, 2), "n_characters": st.sampled_from([261, 262]),
        "activation": st.sampled_from(["relu", "tanh"]), "max_characters_per_token": st.integers(7, 60)}),
    "dropout": st.floats(0, 0.5), "n_tokens_vocab": st.integers(1, 1000)})


@_fuzz
@given(_valid)
def test_valid_options_round_trip_and_count_what_bilm_allocates(raw):
    opts = parse_options(raw)
    again = parse_options(json.loads(opts.to_json()))
    assert again == opts and again.raw == raw
    assert opts.n_parameters == _meta_parameters(opts)
