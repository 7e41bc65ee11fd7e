"""Models by name: the one shipped inside the package (model/pretrained/<name>/options.json + weights.hdf5)
and the published AllenNLP ELMo models, downloaded on first use into the cache.

MODELS is the one list. A published model's files are fetched from PUBLISHED_BASE_URL (overridable with
$ELMO_PIPELINE_MODELS_URL) into <cache>/models/<name>/ by fsio.pinned_download: the first download
records each file's sha256 and size, every later use verifies them. `tokenization` names the scheme of the
model's training text, which `--tokenizer raw` follows (tokenization.resolve_tokenizer).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_MODEL = "wikitext2-small"
HERE = os.path.dirname(os.path.abspath(__file__))
PUBLISHED_BASE_URL = "https://allennlp.s3.amazonaws.com/models/elmo"
BASE_URL_ENV = "ELMO_PIPELINE_MODELS_URL"


@dataclass(frozen=True)
class ModelEntry:
    """One named model. stem: '<folder>/<file prefix>' of a published model under the base URL (its files are
    <stem>_options.json and <stem>_weights.hdf5); None for a shipped one. shape: its synthetic.PUBLISHED_OPTIONS
    name (published models). tokenization: wikitext | moses (tokenization.RAW_SCHEMES)."""
    name: str
    tokenization: str
    trained_on: str
    stem: str | None = None
    shape: str | None = None


MODELS: dict[str, ModelEntry] = {m.name: m for m in (
    ModelEntry("wikitext2-small", "wikitext", "WikiText-2 (shipped; MODEL_CARD.md)"),
    ModelEntry("small", "moses", "1B Word Benchmark", "2x1024_128_2048cnn_1xhighway/elmo_2x1024_128_2048cnn_1xhighway",
               "small"),
    ModelEntry("medium", "moses", "1B Word Benchmark", "2x2048_256_2048cnn_1xhighway/elmo_2x2048_256_2048cnn_1xhighway",
               "medium"),
    ModelEntry("original", "moses", "1B Word Benchmark",
               "2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway", "original"),
    ModelEntry("original-5.5B", "moses", "Wikipedia + WMT 2008-2012 news crawl (5.5B tokens)",
               "2x4096_512_2048cnn_2xhighway_5.5B/elmo_2x4096_512_2048cnn_2xhighway_5.5B", "original"),
)}


def entry(name: str) -> ModelEntry:
    if name not in MODELS:
        raise ValueError(f"no model named {name!r}; known: {', '.join(MODELS)} (or pass --options-file and --weight-file)")
    return MODELS[name]


def available_models() -> list[str]:
    """The shipped models present in this install."""
    return sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "weights.hdf5")))


def is_published(name: str) -> bool:
    """True for a model downloaded from the published URLs (not shipped, not custom files)."""
    return name in MODELS and MODELS[name].stem is not None


def base_url() -> str:
    return os.environ.get(BASE_URL_ENV, PUBLISHED_BASE_URL).rstrip("/")


def model_urls(name: str) -> dict[str, str]:
    """{"options": url, "weights": url} of a published model (under base_url())."""
    e = entry(name)
    if e.stem is None:
        raise ValueError(f"{name!r} is shipped with the package, not downloaded")
    return {"options": f"{base_url()}/{e.stem}_options.json", "weights": f"{base_url()}/{e.stem}_weights.hdf5"}


def cache_folder(name: str) -> str:
    from elmo_pipeline.fsio import cache_dir
    return os.path.join(cache_dir(), "models", name)


def model_files(name: str = DEFAULT_MODEL, progress: bool | None = None) -> tuple[str, str, str | None]:
    """(options.json, weights.hdf5, vocab.txt or None) of a model by name: a shipped one's files (verified against
    its sha256sums.txt), or a published one's cached copies (downloaded on first use, verified on every use)."""
    e = entry(name)
    if e.stem is not None:
        from elmo_pipeline.fsio import pinned_download
        folder, urls = cache_folder(name), model_urls(name)
        from elmo_pipeline.model.options import OPTIONS_MAX_BYTES
        return (pinned_download(urls["options"], os.path.join(folder, "options.json"), progress,
                                max_bytes=OPTIONS_MAX_BYTES),
                pinned_download(urls["weights"], os.path.join(folder, "weights.hdf5"), progress,
                                max_bytes=weights_max_bytes(name)), None)
    folder = os.path.join(HERE, name)
    options, weights = os.path.join(folder, "options.json"), os.path.join(folder, "weights.hdf5")
    if not (os.path.isfile(options) and os.path.isfile(weights)):
        have = ", ".join(available_models()) or "none"
        raise FileNotFoundError(f"no shipped model named {name!r} in {HERE} (shipped: {have}); "
                                "pass --options-file and --weight-file")
    verify_model_folder(folder)
    vocab = os.path.join(folder, "vocab.txt")
    return options, weights, vocab if os.path.isfile(vocab) else None


WEIGHTS_SLACK_BYTES = 64 << 20    # HDF5 metadata and datasets beyond the biLM's in a published weights file


def weights_max_bytes(name: str) -> int:
    """The most bytes a published model's weights file may have: its parameters as float64, and WEIGHTS_SLACK_BYTES
    (its download stops there: a mirror's endless answer never fills the disk)."""
    from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
    opts = PUBLISHED_OPTIONS[entry(name).shape]
    return 8 * _parameters(json.dumps({"lstm": opts["lstm"], "char_cnn": opts["char_cnn"]}, sort_keys=True)) \
        + WEIGHTS_SLACK_BYTES


def model_tokenization(name: str | None) -> str | None:
    """The tokenization scheme of a named model's training text; None for custom files."""
    return entry(name).tokenization if name in MODELS else None


def describe(name: str) -> dict:
    """What `elmo-pipeline models` shows: layers, output dim, LSTM size, parameters, tokenization, cache state
    and the weight file's size where it is on disk."""
    from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS
    e = entry(name)
    if e.stem is None:
        folder = os.path.join(HERE, name)
        with open(os.path.join(folder, "options.json"), encoding="utf-8") as f:
            opts = json.load(f)
        weights, state = os.path.join(folder, "weights.hdf5"), "shipped"
    else:
        from elmo_pipeline.fsio import pinned_record
        opts = PUBLISHED_OPTIONS[e.shape]
        weights = os.path.join(cache_folder(name), "weights.hdf5")
        state = "cached" if os.path.isfile(weights) and pinned_record(weights) else "not downloaded"
    lstm = opts["lstm"]
    return {"name": name, "layers": lstm["n_layers"] + 1, "dim": 2 * lstm["projection_dim"], "lstm_dim": lstm["dim"],
            "parameters": _parameters(json.dumps({"lstm": lstm, "char_cnn": opts["char_cnn"]}, sort_keys=True)),
            "tokenization": e.tokenization, "trained_on": e.trained_on, "state": state,
            "weights_bytes": os.path.getsize(weights) if os.path.isfile(weights) else None}


def _parameters(options_json: str) -> int:
    """Parameters of the biLM encoder (char-CNN + LSTMs) these options describe (BiLMOptions.n_parameters)."""
    from elmo_pipeline.model.options import parse_options
    return parse_options(json.loads(options_json)).n_parameters


SUMS = "sha256sums.txt"   # "<sha256>  <file name>" per line, recorded when the model was shipped


SUMS_BYTES = 1 << 16     # the largest sha256sums.txt read


def verify_model_folder(folder: str) -> list[str]:
    """Check the files of a model folder (shipped or exported) against its recorded sha256sums.txt (if any; lines
    as sha256sum writes them, text or binary mode): a damaged or replaced file raises ValueError "sha256 mismatch"
    naming it, before anything loads it; a line of another form, or naming no file of the folder, ValueError naming
    the line. Returns the names it records ([] without one)."""
    sums = os.path.join(folder, SUMS)
    if not os.path.isfile(sums):
        return []
    with open(sums, "rb") as f:
        data = f.read(SUMS_BYTES + 1)
    if len(data) > SUMS_BYTES:
        raise ValueError(f"{sums}: over {SUMS_BYTES} bytes, not a model folder's record")
    names = []
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]([^/\\]+)", line.rstrip("\r"))
        if m is None or m.group(2) in (".", ".."):
            raise ValueError(f"{sums}: line {n} is not '<sha256>  <file name>' of a file in the folder")
        path = os.path.join(folder, m.group(2))
        try:
            st = os.stat(path)
        except OSError as e:
            raise ValueError(f"{sums}: line {n}: {path} cannot be read ({e.strerror})") from None
        _verified(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, m.group(1).lower())
        names.append(m.group(2))
    return names


@lru_cache(maxsize=64)
def _verified(path: str, size: int, mtime_ns: int, ctime_ns: int, digest: str) -> None:
    from elmo_pipeline.fsio import local_path
    local_path(path, sha256=digest)     # ValueError "<path>: sha256 mismatch (expected ..., found ...)"


def default_model_files() -> tuple[str, str, str | None]:
    return model_files(DEFAULT_MODEL)
