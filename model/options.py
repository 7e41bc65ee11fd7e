"""The biLM's options.json (bilm-tf / AllenNLP layout), validated with errors that name the key."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from fsio import open_url

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")   # precisions the biLM may run in
STATE_MODES = ("stateless", "warm", "stateful")        # what each sentence's LSTMs start from (model/embedder.py)


def sentences_independent(state: str) -> bool:
    """Whether a sentence's vectors depend on nothing but the sentence in this state mode (stateless, warm): its
    batches may then be sorted by length and laid end to end in the LSTMs' lanes. Stateful carries each batch
    row's state to the next batch, so its batches keep input order, one sentence a row."""
    return state != "stateful"


class OptionsError(ValueError):
    """options.json is unreadable or a key is missing or wrong."""


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
        return int(self.char_cnn.get("max_characters_per_token", 50))

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=True)


def _get(d: dict, path: str, kind, *, default: Any = ..., where: str = "options.json"):
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is not ...:
                return default
            raise OptionsError(f"{where}: missing key '{path}'")
        cur = cur[part]
    if cur is None and default is not ...:
        return default
    try:
        if kind is bool:
            if not isinstance(cur, bool):
                raise TypeError
            return cur
        if kind is list:
            if not isinstance(cur, list):
                raise TypeError
            return cur
        value = kind(cur)
    except (TypeError, ValueError):
        raise OptionsError(f"{where}: key '{path}' should be {kind.__name__}, found {cur!r}") from None
    return value


def parse_options(raw: dict, where: str = "options.json") -> BiLMOptions:
    """Validate an options dict; raise OptionsError naming the bad key."""
    if not isinstance(raw, dict):
        raise OptionsError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    n_layers = _get(raw, "lstm.n_layers", int, where=where)
    dim = _get(raw, "lstm.dim", int, where=where)
    proj = _get(raw, "lstm.projection_dim", int, where=where)
    for key, v in (("lstm.n_layers", n_layers), ("lstm.dim", dim), ("lstm.projection_dim", proj)):
        if v <= 0:
            raise OptionsError(f"{where}: key '{key}' must be positive, found {v}")
    cell_clip = _get(raw, "lstm.cell_clip", float, default=None, where=where)
    proj_clip = _get(raw, "lstm.proj_clip", float, default=None, where=where)
    skip = _get(raw, "lstm.use_skip_connections", bool, default=False, where=where)
    char_cnn = raw.get("char_cnn")
    n_tokens_vocab = None
    if char_cnn is not None:
        _get(raw, "char_cnn.embedding.dim", int, where=where)
        filters = _get(raw, "char_cnn.filters", list, where=where)
        if not filters or not all(isinstance(f, list) and len(f) == 2 for f in filters):
            raise OptionsError(f"{where}: key 'char_cnn.filters' should be a list of [width, n_filters], found {filters!r}")
        _get(raw, "char_cnn.n_highway", int, default=0, where=where)
        n_chars = _get(raw, "char_cnn.n_characters", int, default=262, where=where)
        if n_chars not in (261, 262):
            raise OptionsError(f"{where}: key 'char_cnn.n_characters' should be 261 or 262, found {n_chars}")
        act = _get(raw, "char_cnn.activation", str, default="relu", where=where)
        if act not in ("relu", "tanh"):
            raise OptionsError(f"{where}: key 'char_cnn.activation' should be 'relu' or 'tanh', found {act!r}")
        max_chars = _get(raw, "char_cnn.max_characters_per_token", int, default=50, where=where)
        widest = max(int(w) for w, _ in filters)
        if max_chars < widest:
            raise OptionsError(f"{where}: key 'char_cnn.max_characters_per_token' ({max_chars}) is smaller than the widest filter ({widest})")
    else:
        n_tokens_vocab = _get(raw, "n_tokens_vocab", int, where=where)
    return BiLMOptions(raw, n_layers, dim, proj, cell_clip, proj_clip, skip, char_cnn, n_tokens_vocab)


def load_options(url: str) -> BiLMOptions:
    """Read and validate options.json from a path or fsspec URL."""
    try:
        with open_url(url, "rt") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise OptionsError(f"{url}: not valid JSON ({e})") from None
    return parse_options(raw, where=str(url))
