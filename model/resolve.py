"""The model's one identity, for every entry point (`run`, `plan`, `elmo`, ElmoEmbedder.from_name,
transforms.inference, the pipeline's workers): ModelSpec.

A model is given as a name (model.pretrained: shipped, or published and downloaded into the cache on first use,
verified on every use), as an options file and a weight file (paths or URLs: "custom"), or not at all (the
shipped default). resolve_model() settles that choice into a ModelSpec; the run's settings are added to it
(dataclasses.replace) and pinned() records the files' sha256. local_files() gives local, verified paths on
whichever machine holds it (remote files fetched into the cache with the run's storage options; a named model
whose launcher paths do not exist here, from model.pretrained, checked against the recorded sha256).

key_prefix hashes everything that changes the vectors (the files' contents, state mode, batch-invariance,
compute and stored dtype, layers, windows, tokenizer and its version); sentence_key(tokens) adds the tokens:
two sentences of one key have the same vectors (bit for bit where the vectors do not depend on the batching).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace

CUSTOM = "custom"       # the name of a model given as files
# what changes the vectors, besides the files' contents (key_prefix); device and threads do not
VECTOR_SETTINGS = ("state", "batch_invariant", "compute_dtype", "dtype", "layers", "duplicate_layer0", "window",
                   "overlap", "tokenizer", "tokenizer_version")


@dataclass(frozen=True)
class ModelSpec:
    """A model and what changes its vectors, as workers receive it.

    Files (paths or URLs; a named model's are local paths) and model_name (the model by name in model.pretrained,
    None for files given: a worker where the launcher's paths do not exist gets its own copy of a named model and
    checks it against weights_sha256); the files' sha256 once pinned(). How it runs: device, torch threads
    (0 = default), state mode, the precision the biLM runs in (float32 | bfloat16 | float16), batch_invariant
    (bit-identical vectors whatever the batching; stateless/warm only). What is stored: dtype, layers (the
    resolved selection), duplicate_layer0; window (the longest sentence embedded whole; 0: no windows) and
    overlap; the tokenizer and its version. storage_options ({protocol: {...}}, retries included): how remote
    files are fetched (not compared, never recorded). kernel_path: the planned record of what computes the vectors
    (model/kernels.py; None on a remote runner), which a --batch-invariant run's workers check (check_kernel_path);
    not in key_prefix."""
    options_file: str
    weight_file: str
    vocab_file: str | None = None
    device: str = "auto"
    state: str = "stateless"
    torch_threads: int = 0
    compute_dtype: str = "float32"
    batch_invariant: bool = False
    storage_options: dict | None = field(default=None, repr=False, compare=False)
    model_name: str | None = None
    weights_sha256: str | None = None
    options_sha256: str | None = None
    vocab_sha256: str | None = None
    dtype: str = "float32"
    layers: str = "all"
    duplicate_layer0: bool = False
    window: int = 0
    overlap: int = 0
    tokenizer: str | None = None
    tokenizer_version: str | None = None
    kernel_path: dict | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The model's name (CUSTOM for files given)."""
        return self.model_name or CUSTOM

    @property
    def tokenization(self) -> str | None:
        """The scheme of a named model's training text (None for custom files)."""
        from elmo_pipeline.model.pretrained import model_tokenization
        return model_tokenization(self.name)

    def local_files(self) -> tuple[str, str, str | None]:
        """(options, weights, vocab) as local paths on this machine (files_here)."""
        return files_here(self.options_file, self.weight_file, self.vocab_file, self.model_name,
                          self.weights_sha256, self.storage_options)

    def pinned(self) -> "ModelSpec":
        """This spec with the sha256 of its weights, of its parsed options and of its vocabulary recorded (what
        workers elsewhere check, and what key_prefix hashes)."""
        from elmo_pipeline.fsio import file_sha256
        options_file, weight_file, vocab_file = self.local_files()
        return replace(self, weights_sha256=file_sha256(weight_file), options_sha256=_digest(_json(options_file)),
                       vocab_sha256=file_sha256(vocab_file) if vocab_file else None)

    def identity(self) -> dict:
        """The files as given, the weights' sha256 and the parsed options, for the manifest and the run key."""
        from elmo_pipeline.fsio import file_sha256
        options_file, weight_file, _ = self.local_files()
        return {"options_file": self.options_file, "weight_file": self.weight_file, "vocab_file": self.vocab_file,
                "weights_sha256": self.weights_sha256 or file_sha256(weight_file), "options": _json(options_file)}

    def check_options(self, options_file: str) -> None:
        """ValueError when the options file here is not the one pinned() recorded (a worker loading the model)."""
        if self.options_sha256 and _digest(_json(options_file)) != self.options_sha256:
            raise ValueError(f"{options_file}: not the options the run was planned with")

    def check_kernel_path(self, embedder) -> None:
        """ValueError when a --batch-invariant run's worker would compute on another kernel path than the planned
        one (model/kernels.py: its loop, CPU kernel class, versions, math modes, dtypes): other bits under the
        same key prefix. Nothing to check without a planned record (a remote runner's) or batch invariance."""
        if self.kernel_path is None or not self.batch_invariant:
            return
        from elmo_pipeline.model.kernels import embedder_kernel_path, kernel_difference
        differ = kernel_difference(self.kernel_path, embedder_kernel_path(embedder, self.dtype))
        if differ:
            raise ValueError(f"this worker computes vectors on another kernel path than the run was planned with "
                             f"(planned vs here: {differ}): its bits would differ (docs/exactness.md#kernel-path)")

    @property
    def key_prefix(self) -> str:
        """A short hash (16 hex digits) of everything that changes the vectors: the files' contents (pinned())
        and VECTOR_SETTINGS. ValueError before pinned()."""
        if not self.weights_sha256 or not self.options_sha256:
            raise ValueError("a model's key prefix needs its files' sha256: ModelSpec.pinned()")
        settings = {k: v for k, v in asdict(self).items() if k in VECTOR_SETTINGS}
        return _digest({"weights": self.weights_sha256, "options": self.options_sha256,
                        "vocab": self.vocab_sha256, **settings})[:16]

    def sentence_key(self, tokens, prefix: str | None = None) -> str:
        """The content key of a sentence's vectors (sentence_key; `prefix`: key_prefix, computed once by the
        caller)."""
        return sentence_key(prefix or self.key_prefix, tokens)


def sentence_key(prefix: str, tokens) -> str:
    """A key prefix (ModelSpec.key_prefix) + a hash of the tokens (128 bits)."""
    return prefix + hashlib.sha256(json.dumps(list(tokens), ensure_ascii=False).encode("utf-8")).hexdigest()[:32]


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def _digest(value) -> str:
    """sha256 hex of a JSON value (keys sorted: the same value, the same digest)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def resolve_model(name: str | None = None, options_file: str | None = None, weight_file: str | None = None,
                  vocab_file: str | None = None, storage_options: dict | None = None,
                  progress: bool | None = None) -> ModelSpec:
    """The model of a name, of options + weight files (both, and no name), or the shipped default (neither);
    vocab_file: the one given, else a named model's own. A published model is downloaded here on first use
    (progress: its bar on / off / None: when stderr is a terminal) and verified; a bad choice is ValueError
    (the one place that checks "both files or neither")."""
    if options_file or weight_file:
        if not (options_file and weight_file) or name:
            raise ValueError("give the options file and the weight file together (--options-file, --weight-file), "
                             "or a model name (--model), not both")
        return ModelSpec(options_file, weight_file, vocab_file, storage_options=storage_options)
    from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
    name = name or DEFAULT_MODEL
    options, weights, vocab = model_files(name, progress)
    return ModelSpec(options, weights, vocab_file or vocab, storage_options=storage_options, model_name=name)


def fetch_model_files(options_file: str, weight_file: str, vocab_file: str | None = None,
                      storage_options: dict | None = None) -> tuple[str, str, str | None]:
    """Local paths of model files given as paths or URLs (remote ones downloaded once into the cache; remote options
    read first within their bound, OPTIONS_MAX_BYTES: a larger file is never fetched whole)."""
    from elmo_pipeline.fsio import is_local_url, local_path
    from elmo_pipeline.model.options import read_options_file
    if not is_local_url(options_file):
        read_options_file(options_file, storage_options)
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
