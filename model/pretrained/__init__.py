"""Models shipped inside the package (model/pretrained/<name>/options.json + weights.hdf5)."""
from __future__ import annotations

import os
from functools import lru_cache

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
    verify_model_folder(folder)
    vocab = os.path.join(folder, "vocab.txt")
    return options, weights, vocab if os.path.isfile(vocab) else None


SUMS = "sha256sums.txt"   # "<sha256>  <file name>" per line, recorded when the model was shipped


def verify_model_folder(folder: str) -> None:
    """Check the files of a shipped model against its recorded sha256sums.txt (if any): a damaged or
    replaced file raises ValueError "sha256 mismatch" naming it, before anything loads it."""
    sums = os.path.join(folder, SUMS)
    if not os.path.isfile(sums):
        return
    with open(sums, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                digest, name = line.split(None, 1)
                path = os.path.join(folder, name.strip())
                st = os.stat(path)
                _verified(path, st.st_size, st.st_mtime_ns, digest.lower())


@lru_cache(maxsize=64)
def _verified(path: str, size: int, mtime_ns: int, digest: str) -> None:
    from fsio import local_path
    local_path(path, sha256=digest)     # ValueError "<path>: sha256 mismatch (expected ..., found ...)"


def default_model_files() -> tuple[str, str, str | None]:
    return model_files(DEFAULT_MODEL)
