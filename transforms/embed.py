"""The model on the pipeline's workers: what to load (ModelSpec; which files: model/resolve.py), loading it
once per process, and the --layers selection. No Beam import.

Embedder output: float32 (L, N, 2P), L = LSTM layers + 1, layer 0 = token vector duplicated ([x, x]).
Selections: "all" | "top" | "average" | "0,1,2" (layer indices).
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
        """(options, weights, vocab) as local paths on this machine (model.resolve.files_here: remote files
        fetched with this spec's storage options, so model downloads retry like the data path; a named model
        not at the launcher's paths here, from model.pretrained, checked against weights_sha256)."""
        from elmo_pipeline.model.resolve import files_here
        return files_here(self.options_file, self.weight_file, self.vocab_file, self.model_name,
                          self.weights_sha256, self.storage_options)


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

    from elmo_pipeline.model.device import resolve_device
    from elmo_pipeline.model.embedder import ElmoEmbedder
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    model = _OFFERED.pop((spec.options_file, spec.weight_file), None)
    options_file, weight_file, vocab_file = spec.local_files()
    return ElmoEmbedder(options_file, weight_file, device=resolve_device(spec.device, share_gpus=True), model=model,
                        state=spec.state, vocab_file=vocab_file, dtype=spec.compute_dtype,
                        batch_invariant=spec.batch_invariant)
