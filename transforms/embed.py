"""The model on the pipeline's workers: what to load (ModelSpec), loading it once per process, its identity
for the manifest, and the --layers selection. No Beam import.

Embedder output: float32 (L, N, 2P), L = LSTM layers + 1, layer 0 = token vector duplicated ([x, x]).
Selections: "all" | "top" | "average" | "0,1,2" (layer indices).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how: files (paths or URLs), device, state mode, torch threads (0 = default), the
    precision the biLM runs in (float32 | bfloat16 | float16), batch_invariant (bit-identical vectors whatever
    the batching; stateless/warm only; default off, as ElmoEmbedder), and the storage options
    ({protocol: {...}}, retries included) that remote model files are fetched with. model_name: the model by
    name (model.pretrained) when the files came from there, so that a worker on another machine, where the
    launcher's paths do not exist, gets its own copy (shipped, or downloaded into its cache) and checks it
    against weights_sha256."""
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

    def local_files(self) -> tuple[str, str, str | None]:
        """(options, weights, vocab) as local paths: remote files fetched into the cache (fsio.local_path)
        with this spec's storage options, so model downloads retry like the data path; a named model whose
        files are not at the launcher's paths here, from model.pretrained, verified against weights_sha256."""
        from fsio import is_local_url
        paths = [p for p in (self.options_file, self.weight_file, self.vocab_file) if p]
        if self.model_name and not all(is_local_url(p) and os.path.exists(p.removeprefix("file://")) for p in paths):
            from fsio import file_sha256
            from model.pretrained import model_files
            options, weights, vocab = model_files(self.model_name)
            if self.weights_sha256 and file_sha256(weights) != self.weights_sha256:
                raise ValueError(f"model {self.model_name!r} here ({weights}) is not the one the run was planned "
                                 f"with (weights sha256 {self.weights_sha256})")
            return options, weights, self._vocab_here(vocab)
        return fetch_model_files(self.options_file, self.weight_file, self.vocab_file, self.storage_options)

    def _vocab_here(self, model_vocab: str | None) -> str | None:
        """The vocabulary on this machine when the model files came from model.pretrained: the one given, where
        it can be read here (a URL, or a path that exists), else the named model's own."""
        from fsio import is_local_url, local_path
        v = self.vocab_file
        if not v:
            return None
        if not is_local_url(v):
            return local_path(v, storage_options=self.storage_options)
        return v if os.path.exists(v.removeprefix("file://")) else model_vocab


def fetch_model_files(options_file: str, weight_file: str, vocab_file: str | None = None,
                      storage_options: dict | None = None) -> tuple[str, str, str | None]:
    """Local paths of model files given as paths or URLs (remote ones downloaded once into the cache)."""
    from fsio import local_path
    return (local_path(options_file, storage_options=storage_options),
            local_path(weight_file, storage_options=storage_options),
            local_path(vocab_file, storage_options=storage_options) if vocab_file else None)


def parse_layers(spec: str, n_layers: int) -> list[int] | str:
    """'all' -> [0..L-1], 'top' -> [L-1], 'average' -> 'average', '0,2' -> [0, 2] (validated)."""
    spec = spec.strip().lower()
    if spec == "all":
        return list(range(n_layers))
    if spec == "top":
        return [n_layers - 1]
    if spec == "average":
        return "average"
    try:
        layers = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers must be all, top, average or indices like 0,1,2; got {spec!r}") from None
    bad = [k for k in layers if not 0 <= k < n_layers]
    if not layers or bad or len(set(layers)) != len(layers):
        raise ValueError(f"--layers {spec!r}: indices must be distinct and in 0..{n_layers - 1}")
    return layers


_OFFERED: dict = {}   # (options_file, weight_file) -> a BiLM the launcher already loaded, in this process


def offer_model(options_file: str, weight_file: str, model) -> None:
    """Let this process's first load_embedder of these files take `model` instead of loading them again
    (a local runner's workers run in the launcher's process; remote workers never see it)."""
    _OFFERED.clear()
    _OFFERED[(options_file, weight_file)] = model


def withdraw_models() -> None:
    """Drop an offered model nobody took (the run is over)."""
    _OFFERED.clear()


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning each large block to the OS.

    A worker allocates tens of MB per batch and per shard (model outputs, shard columns, encoded pages) and
    frees them soon after; by default every such block is a fresh mmap whose pages the kernel faults in and
    zeroes again, a cost that grows with the output width (it was a large part of the scatter into the model's
    output buffer in a profile of the near-free wide model; not a figure of a repo benchmark).
    With the thresholds raised, blocks come from the heap and are reused; the resident size stays at the
    process's high-water mark, which --shard-bytes and the batch budget bound. True if applied (glibc only)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):      # not glibc: nothing to tune
        return False


def load_embedder(spec: ModelSpec):
    """An ElmoEmbedder for `spec` (sets torch's intra-op threads first when torch_threads > 0), in a
    process whose allocator keeps freed memory (reuse_freed_memory)."""
    import torch
    reuse_freed_memory()

    from model.device import resolve_device
    from model.embedder import ElmoEmbedder
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    model = _OFFERED.pop((spec.options_file, spec.weight_file), None)
    options_file, weight_file, vocab_file = spec.local_files()
    return ElmoEmbedder(options_file, weight_file, device=resolve_device(spec.device, share_gpus=True), model=model,
                        state=spec.state, vocab_file=vocab_file, dtype=spec.compute_dtype,
                        batch_invariant=spec.batch_invariant)


def model_identity(spec: ModelSpec) -> dict:
    """Model files, weights sha256, parsed options and how the vectors are computed (batch_invariant), for the
    manifest."""
    import json

    from fsio import file_sha256
    options_file, weight_file, _ = spec.local_files()
    with open(options_file) as f:
        options = json.load(f)
    return {"options_file": spec.options_file, "weight_file": spec.weight_file, "vocab_file": spec.vocab_file,
            "weights_sha256": file_sha256(weight_file), "options": options,
            "batch_invariant": spec.batch_invariant}
