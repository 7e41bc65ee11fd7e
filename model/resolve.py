"""Which model files to load, in one place for every entry point (`run`, `plan`, `elmo`, ElmoEmbedder.from_name,
transforms.inference, the pipeline's workers).

A model is given as a name (model.pretrained: shipped, or published and downloaded into the cache on first use,
verified on every use), as an options file and a weight file (paths or URLs: "custom"), or not at all (the
shipped default). resolve_model() settles that choice; ResolvedModel.local_files() gives local, verified paths
(remote files fetched into the cache with the run's storage options). files_here() does the same on a worker,
which may run on a machine where the launcher's paths do not exist.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

CUSTOM = "custom"       # the name of a model given as files


@dataclass(frozen=True)
class ResolvedModel:
    """A model choice settled: its name (CUSTOM for files given) and its files as given (paths or URLs; a named
    model's are local paths), with the storage options ({protocol: {...}}) remote files are fetched with."""
    name: str
    options_file: str
    weight_file: str
    vocab_file: str | None = None
    storage_options: dict | None = field(default=None, repr=False, compare=False)

    @property
    def model_name(self) -> str | None:
        """The name a worker elsewhere resolves again (None for custom files)."""
        return None if self.name == CUSTOM else self.name

    @property
    def tokenization(self) -> str | None:
        """The scheme of a named model's training text (None for custom files)."""
        from elmo_pipeline.model.pretrained import model_tokenization
        return model_tokenization(self.name)

    def local_files(self) -> tuple[str, str, str | None]:
        """(options, weights, vocab) as local paths (files_here)."""
        return files_here(self.options_file, self.weight_file, self.vocab_file, self.model_name,
                          storage_options=self.storage_options)

    def identity(self) -> dict:
        """The files as given, the weights' sha256 and the parsed options, for the manifest and the run key."""
        from elmo_pipeline.fsio import file_sha256
        options_file, weight_file, _ = self.local_files()
        with open(options_file) as f:
            options = json.load(f)
        return {"options_file": self.options_file, "weight_file": self.weight_file, "vocab_file": self.vocab_file,
                "weights_sha256": file_sha256(weight_file), "options": options}


def resolve_model(name: str | None = None, options_file: str | None = None, weight_file: str | None = None,
                  vocab_file: str | None = None, storage_options: dict | None = None,
                  progress: bool | None = None) -> ResolvedModel:
    """The model of a name, of options + weight files (both, and no name), or the shipped default (neither);
    vocab_file: the one given, else a named model's own. A published model is downloaded here on first use
    (progress: its bar on / off / None: when stderr is a terminal) and verified; a bad choice is ValueError."""
    if options_file or weight_file:
        if not (options_file and weight_file) or name:
            raise ValueError("give --options-file and --weight-file together, or --model NAME, not both")
        return ResolvedModel(CUSTOM, options_file, weight_file, vocab_file, storage_options)
    from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
    name = name or DEFAULT_MODEL
    options, weights, vocab = model_files(name, progress)
    return ResolvedModel(name, options, weights, vocab_file or vocab, storage_options)


def fetch_model_files(options_file: str, weight_file: str, vocab_file: str | None = None,
                      storage_options: dict | None = None) -> tuple[str, str, str | None]:
    """Local paths of model files given as paths or URLs (remote ones downloaded once into the cache)."""
    from elmo_pipeline.fsio import local_path
    return (local_path(options_file, storage_options=storage_options),
            local_path(weight_file, storage_options=storage_options),
            local_path(vocab_file, storage_options=storage_options) if vocab_file else None)


def files_here(options_file: str, weight_file: str, vocab_file: str | None = None, model_name: str | None = None,
               weights_sha256: str | None = None, storage_options: dict | None = None) -> tuple[str, str, str | None]:
    """(options, weights, vocab) as local paths on this machine: remote files fetched into the cache; a named
    model whose files are not at the launcher's paths here, from model.pretrained, verified against
    weights_sha256 (ValueError when it differs)."""
    from elmo_pipeline.fsio import is_local_url
    paths = [p for p in (options_file, weight_file, vocab_file) if p]
    if model_name and not all(is_local_url(p) and os.path.exists(p.removeprefix("file://")) for p in paths):
        from elmo_pipeline.fsio import file_sha256
        from elmo_pipeline.model.pretrained import model_files
        options, weights, vocab = model_files(model_name)
        if weights_sha256 and file_sha256(weights) != weights_sha256:
            raise ValueError(f"model {model_name!r} here ({weights}) is not the one the run was planned "
                             f"with (weights sha256 {weights_sha256})")
        return options, weights, _vocab_here(vocab_file, vocab, storage_options)
    return fetch_model_files(options_file, weight_file, vocab_file, storage_options)


def _vocab_here(vocab_file: str | None, model_vocab: str | None, storage_options: dict | None) -> str | None:
    """The vocabulary on this machine when the model files came from model.pretrained: the one given, where
    it can be read here (a URL, or a path that exists), else the named model's own."""
    from elmo_pipeline.fsio import is_local_url, local_path
    if not vocab_file:
        return None
    if not is_local_url(vocab_file):
        return local_path(vocab_file, storage_options=storage_options)
    return vocab_file if os.path.exists(vocab_file.removeprefix("file://")) else model_vocab
