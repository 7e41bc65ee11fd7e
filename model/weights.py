"""Load and save the biLM in the bilm-tf / AllenNLP file layout: options.json + weights.hdf5.

HDF5 datasets (TF variable layout, float32):
  char_embed                                   (261, E)   no row for padding: we add a zero row 0
  CNN/W_cnn_{i}                                (1, width, E, n_filters_i)   conv2d kernel
  CNN/b_cnn_{i}                                (n_filters_i,)
  CNN_high_{k}/W_transform, W_carry            (F, F)     x @ W (TF: input on the left)
  CNN_high_{k}/b_transform, b_carry            (F,)
  CNN_proj/W_proj (F, P), CNN_proj/b_proj (P,)            only when F != P
  embedding                                    (V, P)     word token encoder instead of the CNN
  RNN_{d}/RNN/MultiRNNCell/Cell{k}/LSTMCell/W_0    (D_in + P, 4H)  [input; recurrent] rows, gates i,j,f,o
                                         .../B      (4H,)           without TF's run-time forget bias +1
                                         .../W_P_0  (H, P)
  d = 0 forward, 1 backward; k = layer.
No pickle anywhere: a weights file is plain arrays.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from contextlib import contextmanager

import h5py
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.fsio import atomic_write, local_path, replacing, url_fs
from elmo_pipeline.model.options import N_CHAR_ROWS, BiLMOptions, load_options


class WeightsError(ValueError):
    """A weights file is unreadable, lacks a dataset, or has a wrong shape."""


def _cell(d: int, k: int) -> str:
    return f"RNN_{d}/RNN/MultiRNNCell/Cell{k}/LSTMCell"


def weight_shapes(opts: BiLMOptions) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every dataset of the layout (module docstring) these options use: name -> (shape, the options.json keys
    the shape follows), in reading order. Computed from the options alone: no tensor is built. char_embed has the
    trained N_CHAR_ROWS - 1 rows here (a file with the padding row, N_CHAR_ROWS, is accepted too)."""
    P, H = opts.projection_dim, opts.lstm_dim
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    if opts.char_cnn is not None:
        E, F_ = opts.char_cnn["embedding"]["dim"], opts.n_filters
        shapes["char_embed"] = (N_CHAR_ROWS - 1, E), "char_cnn.embedding.dim"
        for i, (width, num) in enumerate(opts.filters):
            shapes[f"CNN/W_cnn_{i}"] = (1, width, E, num), f"char_cnn.filters[{i}], char_cnn.embedding.dim"
            shapes[f"CNN/b_cnn_{i}"] = (num,), f"char_cnn.filters[{i}]"
        for k in range(opts.char_cnn.get("n_highway") or 0):
            for part in ("transform", "carry"):
                shapes[f"CNN_high_{k}/W_{part}"] = (F_, F_), "char_cnn.filters (counts summed), char_cnn.n_highway"
                shapes[f"CNN_high_{k}/b_{part}"] = (F_,), "char_cnn.filters (counts summed), char_cnn.n_highway"
        if F_ != P:
            shapes["CNN_proj/W_proj"] = (F_, P), "char_cnn.filters (counts summed), lstm.projection_dim"
            shapes["CNN_proj/b_proj"] = (P,), "lstm.projection_dim"
    else:
        shapes["embedding"] = (opts.n_tokens_vocab, P), "n_tokens_vocab, lstm.projection_dim"
    for d in range(2):
        for k in range(opts.n_layers):
            g = _cell(d, k)
            shapes[f"{g}/W_0"] = (2 * P, 4 * H), "lstm.projection_dim, lstm.dim, lstm.n_layers"
            shapes[f"{g}/B"] = (4 * H,), "lstm.dim, lstm.n_layers"
            shapes[f"{g}/W_P_0"] = (H, P), "lstm.dim, lstm.projection_dim, lstm.n_layers"
    return shapes


def check_weights_match(f: h5py.File, opts: BiLMOptions, where: str) -> None:
    """WeightsError unless the file holds every dataset the options use, in the shape they imply, of plain floats
    (_check_floats), and no other model dataset (MODEL_PREFIXES). Reads the HDF5 metadata only, so it runs before
    any tensor is built: options that do not match the weights never allocate what they ask for. Only the file's
    own datasets are read: one named through a link (a soft or an external link, which opens another file: a FIFO
    would block for ever) or keeping its data outside the file (external or virtual storage) is refused unopened, and
    one stored in chunks larger than its shape (a read inflates whole chunks: up to 4 GiB each) unread."""
    used = weight_shapes(opts)
    for name, (shape, keys) in used.items():
        if through_link(f, name):
            raise WeightsError(f"{where}: '{name}' is a link, not a dataset of the file")
        if name not in f:
            raise WeightsError(f"{where}: missing dataset '{name}' (options.json: {keys})")
        ds = f[name]
        if not isinstance(ds, h5py.Dataset):
            raise WeightsError(f"{where}: '{name}' is a group, expected a dataset")
        if ds.external or ds.is_virtual:     # another file's bytes (a FIFO would block, /dev/zero never ends)
            raise WeightsError(f"{where}: dataset '{name}' keeps its data outside the file")
        found = tuple(ds.shape) if ds.shape is not None else ()
        if found != shape and not (name == "char_embed" and found == (N_CHAR_ROWS, shape[1])):
            raise WeightsError(f"{where}: dataset '{name}' has shape {found}, expected {shape} "
                               f"(options.json: {keys})")
        if ds.chunks and any(c > max(n, 1) for c, n in zip(ds.chunks, found)):    # a read inflates whole chunks
            raise WeightsError(f"{where}: dataset '{name}' is stored in chunks {ds.chunks}, larger than its shape "
                               f"{found}")
        _check_floats(ds, name, where)
    names: list[str] = []
    f.visit(names.append)
    unused = sorted(n for n in names if n.startswith(MODEL_PREFIXES) and n not in used
                    and isinstance(f[n], h5py.Dataset))
    if unused:
        raise WeightsError(f"{where}: {len(unused)} dataset(s) the options do not use, e.g. '{unused[0]}' "
                           f"(options.json does not match the weights: lstm.n_layers, char_cnn or filters?)")


def through_link(f: h5py.File, name: str) -> bool:
    """Whether `name` (a path in `f`) or a folder above it is a soft or an external link: each read as a link, from
    the root down, so that none is followed."""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        link = f.get("/".join(parts[:i]), getlink=True)
        if link is None:
            return False
        if not isinstance(link, h5py.HardLink):
            return True
    return False


def _check_floats(ds: h5py.Dataset, name: str, where: str) -> None:
    """WeightsError unless the dataset's elements are plain floats of at most 8 bytes: an HDF5 array (subarray)
    element of K floats passes the shape check (the dataspace's) yet reads as K times the values."""
    try:
        dtype = ds.dtype
    except Exception as e:  # noqa: BLE001 - an HDF5 type numpy has no dtype for
        raise WeightsError(f"{where}: dataset '{name}' has an element type that cannot be read "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if dtype.kind != "f" or dtype.itemsize > 8:
        what = " ".join(str(dtype).split())
        raise WeightsError(f"{where}: dataset '{name}' has elements of type {what[:100]}, expected floats "
                           "(float16, float32 or float64)")


def _read(f, name: str, where: str) -> np.ndarray:
    """A dataset check_weights_match accepted, as float32; WeightsError when unreadable or not finite."""
    ds = f[name]
    try:
        arr = np.asarray(ds[...], dtype=np.float32)
    except (OSError, ValueError, TypeError) as e:
        raise WeightsError(f"{where}: dataset '{name}' cannot be read ({' '.join(str(e).split())})") from None
    bad = arr.size - int(np.isfinite(arr).sum())
    if bad:
        raise WeightsError(f"{where}: dataset '{name}' has {bad} non-finite value(s) (NaN/Inf): corrupted weights")
    return arr


class LayoutGap(Exception):
    """The model holds a parameter or buffer that loading does not set (a model change not followed here): a
    programming error, never a damaged file."""


def _copy(param: torch.Tensor, array: np.ndarray) -> None:
    """param <- array, a view as it comes (a transposed dataset too: torch's strided copy, several times
    numpy's single-threaded ascontiguousarray on the original shape's weights)."""
    with torch.no_grad():
        param.copy_(torch.from_numpy(array))


def _open(weight_file: str, sha256: str | None) -> h5py.File:
    """The weights as an open HDF5 file; with `sha256`, opened from the very bytes that were hashed (read once into
    memory), so a file replaced after the check is never the one loaded."""
    path = local_path(weight_file)
    source = path
    if sha256 is not None:
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != sha256.lower():
            raise WeightsError(f"{weight_file}: sha256 mismatch, not the weights the run was planned with (found "
                               f"{hashlib.sha256(data).hexdigest()}, expected {sha256})")
        source = io.BytesIO(data)
    try:
        return h5py.File(source, "r")
    except OSError as e:
        size = os.path.getsize(path)
        raise WeightsError(f"{weight_file}: not a valid HDF5 file (truncated or corrupted?): {size} bytes, "
                           f"{' '.join(str(e).split())}") from None


@contextmanager
def _damage_named(weight_file: str):
    """h5py's errors on damaged metadata or chunks as one WeightsError."""
    try:
        yield
    except WeightsError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError) as e:
        raise WeightsError(f"{weight_file}: corrupted HDF5 file (truncated or damaged?): "
                           f"{type(e).__name__}: {' '.join(str(e).split())}") from None


def load_weights_into(model: BiLM, weight_file: str, sha256: str | None = None) -> BiLM:
    """Fill `model` from an HDF5 weights file (path or URL). Raises WeightsError naming the problem."""
    with _open(weight_file, sha256) as f:
        with _damage_named(weight_file):
            check_weights_match(f, model.opts, str(weight_file))
            _load(model, f, str(weight_file))
    return model


MODEL_PREFIXES = ("char_embed", "CNN", "embedding", "RNN_")   # other datasets (softmax/...) ride along unread


def _load(model: BiLM, f: h5py.File, where: str) -> None:
    """Copy the datasets into `model` (check_weights_match has accepted the file for model.opts): every parameter,
    so that a model built without initialising them (_unfilled) holds nothing else."""
    filled: set[int] = set()

    def copy(param: torch.Tensor, array: np.ndarray) -> None:
        _copy(param, array)
        filled.add(id(param))

    o = model.opts
    enc = model.token_encoder
    if o.char_cnn is not None:
        char_embed = _read(f, "char_embed", where)
        # Trained files have 261 rows (ids 0..260); ids are +1 shifted at inference, so row 0 is a
        # zero row for padded positions (options say n_characters 262). A 262-row file has it already.
        full = np.zeros((N_CHAR_ROWS, char_embed.shape[1]), np.float32)
        full[N_CHAR_ROWS - char_embed.shape[0]:] = char_embed
        copy(enc.char_embed.weight, full)
        for i, conv in enumerate(enc.convs):
            w = _read(f, f"CNN/W_cnn_{i}", where)
            copy(conv.weight, w[0].transpose(2, 1, 0))                # (num, E, width)
            copy(conv.bias, _read(f, f"CNN/b_cnn_{i}", where))
        for k, hw in enumerate(enc.highways):
            g = f"CNN_high_{k}"
            w = np.concatenate([_read(f, f"{g}/W_transform", where).T, _read(f, f"{g}/W_carry", where).T])
            b = np.concatenate([_read(f, f"{g}/b_transform", where), _read(f, f"{g}/b_carry", where)])
            copy(hw.linear.weight, w)
            copy(hw.linear.bias, b)
        if enc.proj is not None:
            copy(enc.proj.weight, _read(f, "CNN_proj/W_proj", where).T)
            copy(enc.proj.bias, _read(f, "CNN_proj/b_proj", where))
    else:
        copy(enc.embedding.weight, _read(f, "embedding", where))
    for d, stack in enumerate((model.forward_layers, model.backward_layers)):
        for k, layer in enumerate(stack):
            g = _cell(d, k)
            d_in = layer.w_in.shape[1]
            w0 = _read(f, f"{g}/W_0", where)
            copy(layer.w_in, w0[:d_in].T)
            copy(layer.w_rec, w0[d_in:].T)
            copy(layer.bias, _read(f, f"{g}/B", where))
            copy(layer.w_proj, _read(f, f"{g}/W_P_0", where).T)
    missed = [name for name, p in model.named_parameters() if id(p) not in filled]
    if missed:
        raise LayoutGap(f"{where}: the layout leaves parameters unloaded: {', '.join(missed)}")


def check_bilm(options_file: str, weight_file: str, sha256: str | None = None) -> BiLMOptions:
    """The options of a model whose files hold together, checked without building it: the options against their
    schema, the weights' shapes (HDF5 metadata) against the options, then every dataset read once, one at a
    time (readable, finite). OptionsError/WeightsError otherwise, one line."""
    opts = load_options(options_file)
    where = str(weight_file)
    with _open(weight_file, sha256) as f, _damage_named(where):
        check_weights_match(f, opts, where)
        for name in weight_shapes(opts):
            _read(f, name, where)
    return opts


class _InitialisersSkipped(TorchFunctionMode):
    """Inside: torch.nn.init's initialisers and the random fills they make leave their tensor as it is (torch.empty's
    memory, filled after by _load)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


_RANDOM_FILLS = (torch.Tensor.uniform_, torch.Tensor.normal_)


def _unfilled(opts: BiLMOptions) -> BiLM:
    """A BiLM whose parameters are allocated on the CPU but not initialised (_load then fills every one), its
    buffers set: BiLM(opts) would draw random weights only to have them overwritten (what that costs per shape:
    python -m benchmarks.model_load). Built on the CPU, not on the meta device: there, torch's Python reference
    kernels of the initialisers and of to_empty import torch._dynamo and sympy on first use: the load took 1.65 s
    in a fresh process, 0.50 s built here (AMD EPYC Zen 4, family 25, AVX-512 + AVX512_BF16, the original shape:
    benchmarks.model_load, "fresh process")."""
    with _InitialisersSkipped():
        return BiLM(opts)


def load_bilm(options_file: str, weight_file: str, device: str | torch.device = "cpu",
              sha256: str | None = None) -> BiLM:
    """A BiLM (eval mode) from options.json + weights.hdf5, each a path or fsspec URL. The options are checked
    against their schema and the weights' shapes (HDF5 metadata) before the BiLM's tensors are built."""
    opts = load_options(options_file)
    where = str(weight_file)
    with _open(weight_file, sha256) as f:
        with _damage_named(where):
            check_weights_match(f, opts, where)
        model = _unfilled(opts)
        with _damage_named(where):
            _load(model, f, where)
    return model.to(device).eval()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def save_weights(model: BiLM, weight_file: str, extra: dict | None = None) -> None:
    """Write `model` as an HDF5 file in the bilm-tf layout (exact inverse of load_weights_into), with `extra`
    ({dataset name: array}) in the same file; only over nothing or a regular file (fsio.replacing files_only)."""
    o = model.opts
    enc = model.token_encoder
    if "://" in weight_file:
        raise ValueError("save_weights writes local files (h5py needs a seekable file); upload the result with fsspec")
    with replacing(weight_file, files_only=True) as tmp, h5py.File(tmp, "w") as f:  # readers never see half a file
        for name, array in (extra or {}).items():
            f[name] = array
        if o.char_cnn is not None:
            f["char_embed"] = _np(enc.char_embed.weight)[1:]         # drop the inference-only zero row
            for i, conv in enumerate(enc.convs):
                f[f"CNN/W_cnn_{i}"] = _np(conv.weight).transpose(2, 1, 0)[None]
                f[f"CNN/b_cnn_{i}"] = _np(conv.bias)
            for k, hw in enumerate(enc.highways):
                w, b = _np(hw.linear.weight), _np(hw.linear.bias)
                d = hw.dim
                f[f"CNN_high_{k}/W_transform"] = w[:d].T
                f[f"CNN_high_{k}/W_carry"] = w[d:].T
                f[f"CNN_high_{k}/b_transform"] = b[:d]
                f[f"CNN_high_{k}/b_carry"] = b[d:]
            if enc.proj is not None:
                f["CNN_proj/W_proj"] = _np(enc.proj.weight).T
                f["CNN_proj/b_proj"] = _np(enc.proj.bias)
        else:
            f["embedding"] = _np(enc.embedding.weight)
        for d, stack in enumerate((model.forward_layers, model.backward_layers)):
            for k, layer in enumerate(stack):
                g = _cell(d, k)
                f[f"{g}/W_0"] = np.concatenate([_np(layer.w_in).T, _np(layer.w_rec).T])
                f[f"{g}/B"] = _np(layer.bias)
                f[f"{g}/W_P_0"] = _np(layer.w_proj).T


def save_bilm(model: BiLM, options_file: str, weight_file: str, extra: dict | None = None) -> None:
    """Write options.json + weights.hdf5 (local paths) that AllenNLP, bilm-tf and load_bilm read (`extra`: more
    datasets in weights.hdf5), each whole, only over nothing or a regular file (fsio.replacing files_only)."""
    save_weights(model, weight_file, extra)
    raw = dict(model.opts.raw)
    if raw.get("char_cnn") is not None:
        raw["char_cnn"] = {**raw["char_cnn"], "n_characters": N_CHAR_ROWS}
    write_json(options_file, raw)


def write_json(path: str, obj) -> None:
    """`obj` as indented JSON with sorted keys at the local `path`, whole, only over nothing or a regular file."""
    atomic_write(url_fs(path)[0], path, json.dumps(obj, indent=2, sort_keys=True).encode(), files_only=True)


__all__ = ["WeightsError", "check_weights_match", "through_link", "load_bilm", "load_weights_into", "save_bilm", "save_weights",
           "weight_shapes", "write_json"]
