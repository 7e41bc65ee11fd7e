"""Models shipped inside the package (model/pretrained/<name>/options.json + weights.hdf5)."""
from __future__ import annotations

import os

DEFAULT_MODEL = "wikitext2-small"
HERE = os.path.dirname(os.path.abspath(__file__))


def available_models() -> list[str]:
    return sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "weights.hdf5")))


def model_files(name: str = DEFAULT_MODEL) -> tuple[str, str, str | None]:
    """(options.json, weights.hdf5, vocab.txt or None) of a shipped model."""
    folder = os.path.join(HERE, name)
    options, weights = os.path.join(folder, "options.json"), os.path.join(folder, "weights.hdf5")
    if not (os.path.isfile(options) and os.path.isfile(weights)):
        have = ", ".join(available_models()) or "none"
        raise FileNotFoundError(f"no shipped model named {name!r} in {HERE} (shipped: {have}); "
                                "pass --options-file and --weight-file")
    vocab = os.path.join(folder, "vocab.txt")
    return options, weights, vocab if os.path.isfile(vocab) else None


def default_model_files() -> tuple[str, str, str | None]:
    return model_files(DEFAULT_MODEL)
