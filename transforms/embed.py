"""The model on the pipeline's workers, all of its life there: loading a ModelSpec (model/resolve.py) into an
ElmoEmbedder (load_embedder), one per process held through Beam's Shared handle (shared_model: the handle is
passed in), and the --layers selection. No Beam import.

Embedder output: float32 (L, N, 2P), L = LSTM layers + 1, layer 0 = token vector duplicated ([x, x]).
Selections: "all" | "top" | "average" | "0,1,2" (layer indices).
"""
from __future__ import annotations

import json
import threading

from elmo_pipeline.model.resolve import ModelSpec


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


def load_embedder(spec: ModelSpec, model=None):
    """An ElmoEmbedder for `spec` (sets torch's intra-op threads first when torch_threads > 0), in a
    process whose allocator keeps freed memory (reuse_freed_memory); `model`: the BiLM of spec's files, already
    loaded in this process (else loaded here). ValueError when it runs on another kernel path than the planned
    one (ModelSpec.check_kernel_path)."""
    import torch
    reuse_freed_memory()

    from elmo_pipeline.model.device import resolve_device
    from elmo_pipeline.model.embedder import ElmoEmbedder
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    options_file, weight_file, vocab_file = spec.local_files()
    if model is None:
        spec.check_options(options_file)
    embedder = ElmoEmbedder(options_file, weight_file, device=resolve_device(spec.device, share_gpus=True),
                            model=model, state=spec.state, vocab_file=vocab_file, dtype=spec.compute_dtype,
                            batch_invariant=spec.batch_invariant, weights_sha256=spec.weights_sha256)
    spec.check_kernel_path(embedder)        # a --batch-invariant run: the planned kernel path, or one error
    return embedder


class LoadedModel:
    """A process's embedder of one ModelSpec, built on first use (from `model`, a BiLM of its files this process
    already loaded, else from the files); held through Beam's Shared, which needs a weak-referenceable object."""

    def __init__(self, spec: ModelSpec, model=None):
        self.spec, self._model, self._embedder, self._kernel = spec, model, None, None
        self._lock = threading.Lock()

    @property
    def embedder(self):
        with self._lock:
            if self._embedder is None:
                self._embedder, self._model = load_embedder(self.spec, self._model), None
            return self._embedder

    @property
    def kernel(self) -> str:
        """The kernel path this process's embedder computes on (model/kernels.py embedder_kernel_path, at this
        thread's torch threads), as canonical JSON: what each shard's commit record says computed its vectors."""
        embedder = self.embedder
        with self._lock:
            if self._kernel is None:
                from elmo_pipeline.model.kernels import embedder_kernel_path
                self._kernel = json.dumps(embedder_kernel_path(embedder, self.spec.dtype), sort_keys=True)
            return self._kernel


def shared_model(models, spec: ModelSpec, model=None) -> LoadedModel:
    """This process's LoadedModel of `spec` through the handle `models` (Beam's Shared: one per process, kept
    while the caller keeps it and after, until another is acquired). A launcher that runs the workers in its own
    process acquires it first with the BiLM it checked (model); its workers, given the same handle, take it."""
    return models.acquire(lambda: LoadedModel(spec, model), tag=repr(spec))
