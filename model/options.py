"""The biLM's options.json (bilm-tf / AllenNLP layout), validated with errors that name the key."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn

from elmo_pipeline.fsio import open_url

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")   # precisions the biLM may run in
STATE_MODES = ("stateless", "warm", "stateful")        # what each sentence's LSTMs start from (model/embedder.py)


def sentences_independent(state: str) -> bool:
    """Whether a sentence's vectors depend on nothing but the sentence in this state mode (stateless, warm): its
    batches may then be sorted by length and laid end to end in the LSTMs' lanes. Stateful carries each batch
    row's state to the next batch, so its batches keep input order, one sentence a row."""
    return state != "stateful"


class OptionsError(ValueError):
    """options.json is unreadable or a key is missing, of the wrong type or out of bounds."""


@dataclass(frozen=True)
class Bound:
    """The accepted range of one options.json number (inclusive), and the published biLMs' value(s) it is set from."""
    smallest: int | float
    largest: int | float
    published: str


# Every number options.json sets, and the parameters they add up to: the one table of the schema's bounds.
# `largest` is 4-8x the largest value of the published biLMs (bilm-tf small / medium / original / original-5.5B,
# which share one char CNN; n_tokens_vocab: bilm-tf's 1B Word Benchmark vocabulary); one filter's count may take
# the whole summed budget (16x the largest published count); the clips' range only refuses nonsense. So options
# alone never ask for more than `parameters` (about 5.7x the original's; 2 GiB in fp32), and the weights file
# must then hold exactly the shapes the options imply (model/weights.py reads its metadata before any tensor is
# built).
BOUNDS: dict[str, Bound] = {
    # key                                     smallest  largest       published
    "lstm.n_layers":                     Bound(1,       16,           "2"),
    "lstm.dim":                          Bound(1,       16_384,       "1024 / 2048 / 4096"),
    "lstm.projection_dim":               Bound(1,       4_096,        "128 / 256 / 512"),
    "lstm.cell_clip":                    Bound(1e-3,    1e6,          "3"),      # null: no clip
    "lstm.proj_clip":                    Bound(1e-3,    1e6,          "3"),      # null: no clip
    "char_cnn.embedding.dim":            Bound(1,       64,           "16"),
    "char_cnn.filters":                  Bound(1,       32,           "7 [width, count] pairs"),
    "char_cnn.filters[i][0]":            Bound(1,       32,           "widths 1..7"),
    "char_cnn.filters[i][1]":            Bound(1,       16_384,       "counts 32..1024"),
    "char_cnn.filters, counts summed":   Bound(1,       16_384,       "2048"),
    "char_cnn.n_highway":                Bound(0,       8,            "1 / 2"),
    "char_cnn.max_characters_per_token": Bound(1,       256,          "50"),
    "n_tokens_vocab":                    Bound(1,       4_194_304,    "793471"),
    "parameters":                        Bound(1,       536_870_912,  "13.6 M / 28.0 M / 93.6 M"),
}

N_CHAR_ROWS = 262  # the char CNN's embedding rows: 261 trained character rows + row 0, all zeros, for padded positions

CHOICES = {"char_cnn.n_characters": (N_CHAR_ROWS - 1, N_CHAR_ROWS),   # trained rows; with the padding row
           "char_cnn.activation": ("relu", "tanh")}
OPTIONS_MAX_BYTES = 1 << 20     # an options.json is about 1 KB; a larger file is not read


@dataclass(frozen=True)
class BiLMOptions:
    """Parsed model options. `raw` keeps the full options.json dict (written back on save)."""

    raw: dict
    n_layers: int
    lstm_dim: int           # H: LSTM cell size
    projection_dim: int     # P: LSTM output size and token-embedding size
    cell_clip: float | None
    proj_clip: float | None
    use_skip_connections: bool
    char_cnn: dict | None   # None for a word-embedding token encoder
    n_tokens_vocab: int | None

    @property
    def output_dim(self) -> int:
        """D = 2 * P: width of every layer the embedder returns."""
        return 2 * self.projection_dim

    @property
    def filters(self) -> list[tuple[int, int]]:
        return [(int(w), int(n)) for w, n in self.char_cnn["filters"]]

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @property
    def max_characters_per_token(self) -> int:
        return int(self.char_cnn.get("max_characters_per_token") or 50)

    @property
    def n_parameters(self) -> int:
        """Parameters BiLM(self) allocates: the token encoder's and both directions' LSTMs'."""
        return self.encoder_parameters + self.lstm_parameters

    @property
    def lstm_parameters(self) -> int:
        """Per layer and direction: w_in (4H, P), w_rec (4H, P), bias (4H,), w_proj (P, H)."""
        P, H = self.projection_dim, self.lstm_dim
        return 2 * self.n_layers * (8 * H * P + 4 * H + P * H)

    @property
    def encoder_parameters(self) -> int:
        """Char CNN: embedding (262, E), convs, highways (2F, F) + (2F,), projection (P, F) + (P,) when F != P;
        word encoder: embedding (V, P)."""
        P = self.projection_dim
        if self.char_cnn is None:
            return self.n_tokens_vocab * P
        E, F_ = self.char_cnn["embedding"]["dim"], self.n_filters
        convs = sum(n * (w * E + 1) for w, n in self.filters)
        highways = (self.char_cnn.get("n_highway") or 0) * (2 * F_ * F_ + 2 * F_)
        projection = F_ * P + P if F_ != P else 0
        return N_CHAR_ROWS * E + convs + highways + projection

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=True)


_MISSING = object()


def _show(value: Any) -> str:
    """A value for an error line: its JSON-ish repr, cut to 60 characters."""
    try:
        text = repr(value)
    except ValueError:                      # an integer too long to print
        return "a very long integer"
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed, bounded reads from an options dict; each failure an OptionsError naming the key."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def fail(self, key: str, text: str) -> NoReturn:
        raise OptionsError(f"{self.where}: key '{key}' {text}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value at a dotted key; `default` when it is absent or null (required keys: no default)."""
        cur: Any = self.raw
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(cur, dict):
                self.fail(".".join(parts[:i]), f"should be an object, found {_show(cur)}")
            cur = cur.get(part, _MISSING)
            if cur is _MISSING or cur is None:
                if default is _MISSING:
                    self.fail(".".join(parts[: i + 1]), "is missing" if cur is _MISSING else "should not be null")
                return default
        return cur

    def integer(self, key: str, value: Any = _MISSING, bound: str | None = None) -> int:
        """An int (not a bool, not a float such as 2.0) within BOUNDS[bound or key]."""
        value = self.get(key) if value is _MISSING else value
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(key, f"should be an integer, found {_show(value)}")
        return self.bounded(key, value, bound or key)

    def number(self, key: str) -> float | None:
        """A finite int or float within BOUNDS[key], as a float; None when absent or null."""
        value = self.get(key, None)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self.fail(key, f"should be a number or null, found {_show(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(key, f"should be a finite number, found {_show(value)}")
        return float(self.bounded(key, value, key))

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"should be true or false, found {_show(value)}")
        return value

    def choice(self, key: str, default: Any) -> Any:
        value = self.get(key, default)
        allowed = CHOICES[key]
        if type(value) is not type(allowed[0]) or value not in allowed:
            self.fail(key, f"should be one of {', '.join(map(repr, allowed))}, found {_show(value)}")
        return value

    def bounded(self, key: str, value: int | float, bound: str, shown: str | None = None):
        b = BOUNDS[bound]
        shown = shown or f"= {_show(value)}"
        if value < b.smallest:
            self.fail(key, f"{shown} is below the smallest allowed {b.smallest} (published models: {b.published})")
        if value > b.largest:
            self.fail(key, f"{shown} is above the largest allowed {b.largest} (published models: {b.published})")
        return value


def _filters(r: _Reader) -> list:
    """char_cnn.filters: [[width, count], ...], each number and the counts' sum bounded."""
    filters = r.get("char_cnn.filters")
    if not isinstance(filters, list):
        r.fail("char_cnn.filters", f"should be a list of [width, count] pairs, found {_show(filters)}")
    r.bounded("char_cnn.filters", len(filters), "char_cnn.filters", shown=f"has {len(filters)} pairs, which")
    for i, pair in enumerate(filters):
        if not isinstance(pair, list) or len(pair) != 2:
            r.fail("char_cnn.filters", f"should be a list of [width, count] pairs: [{i}] is {_show(pair)}")
        r.integer(f"char_cnn.filters[{i}][0]", pair[0], "char_cnn.filters[i][0]")
        r.integer(f"char_cnn.filters[{i}][1]", pair[1], "char_cnn.filters[i][1]")
    total = sum(n for _, n in filters)
    r.bounded("char_cnn.filters", total, "char_cnn.filters, counts summed", shown=f"counts add up to {total}, which")
    return filters


def _char_cnn(r: _Reader) -> None:
    """Check the char_cnn object (its values stay in raw; BiLMOptions reads them from there)."""
    r.integer("char_cnn.embedding.dim")
    filters = _filters(r)
    r.integer("char_cnn.n_highway", r.get("char_cnn.n_highway", 0))
    r.choice("char_cnn.n_characters", N_CHAR_ROWS)
    r.choice("char_cnn.activation", "relu")
    max_chars = r.integer("char_cnn.max_characters_per_token", r.get("char_cnn.max_characters_per_token", 50))
    widest = max(w for w, _ in filters)
    if max_chars < widest:
        r.fail("char_cnn.max_characters_per_token", f"({max_chars}) is smaller than the widest filter ({widest})")


def parse_options(raw: dict, where: str = "options.json") -> BiLMOptions:
    """Validate an options dict against the schema (types, BOUNDS, CHOICES); raise OptionsError naming the bad key.
    Nothing is allocated from the values: a BiLM built from the result has at most BOUNDS['parameters']."""
    if not isinstance(raw, dict):
        raise OptionsError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    try:
        raw = copy.deepcopy(raw)
    except RecursionError:
        raise OptionsError(f"{where}: nested too deeply") from None
    r = _Reader(raw, where)
    r.get("lstm")
    n_layers, dim, proj = (r.integer(f"lstm.{k}") for k in ("n_layers", "dim", "projection_dim"))
    cell_clip, proj_clip = r.number("lstm.cell_clip"), r.number("lstm.proj_clip")
    skip = r.boolean("lstm.use_skip_connections", False)
    char_cnn = raw.get("char_cnn")
    if char_cnn is not None:
        r.get("char_cnn.embedding")
        _char_cnn(r)
    vocab = r.get("n_tokens_vocab", None if char_cnn is not None else _MISSING)
    if vocab is not None:
        r.integer("n_tokens_vocab", vocab)
    opts = BiLMOptions(raw, n_layers, dim, proj, cell_clip, proj_clip, skip, char_cnn,
                       None if char_cnn is not None else vocab)
    _check_size(opts, r)
    try:
        json.dumps(raw)        # the other keys ride along in raw and are written back (to_json, save_bilm)
    except (TypeError, ValueError, RecursionError) as e:    # a key or value JSON has no form for, a too long integer
        raise OptionsError(f"{where}: not JSON data ({' '.join(str(e).split())[:100]})") from None
    return opts


def _check_size(opts: BiLMOptions, r: _Reader) -> None:
    """The parameters all the options imply together, within BOUNDS['parameters']."""
    b, n = BOUNDS["parameters"], opts.n_parameters
    if n > b.largest:
        keys = "char_cnn.filters, char_cnn.n_highway" if opts.char_cnn is not None else "n_tokens_vocab"
        raise OptionsError(f"{r.where}: the options imply {n} parameters (LSTMs {opts.lstm_parameters}: lstm.n_layers, "
                           f"lstm.dim, lstm.projection_dim; token encoder {opts.encoder_parameters}: {keys}), above "
                           f"the largest allowed {b.largest} (published models: {b.published})")


def load_options(url: str) -> BiLMOptions:
    """Read and validate options.json from a path or fsspec URL (at most OPTIONS_MAX_BYTES)."""
    return parse_options(read_options_file(url), where=str(url))


def read_options_file(url: str, storage_options: dict | None = None) -> dict:
    """The JSON object of an options file (a model's options.json, training's --options), read as nothing else
    reads it: at most OPTIONS_MAX_BYTES + 1 bytes, a local path only when it is a regular file (fsio.open_url: a FIFO
    never blocks, /dev/zero never fills memory); OptionsError otherwise, naming it. Its keys are checked by the
    caller (parse_options; training takes missing keys from its defaults)."""
    with open_url(url, "rb", storage_options, cached=False) as f:     # a remote file too: never fetched whole first
        data = f.read(OPTIONS_MAX_BYTES + 1)
    if len(data) > OPTIONS_MAX_BYTES:
        raise OptionsError(f"{url}: larger than {OPTIONS_MAX_BYTES} bytes, not an options.json")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:      # JSONDecodeError, not UTF-8, an integer too long, nesting
        raise OptionsError(f"{url}: not valid JSON ({' '.join(str(e).split()) or type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise OptionsError(f"{url}: expected a JSON object, found {type(raw).__name__}")
    return raw
