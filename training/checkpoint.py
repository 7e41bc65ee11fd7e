"""Training checkpoints as plain HDF5: tensors as datasets, everything else as one JSON attribute.

Layout of a checkpoint file:
  model/<parameter name>                 the BiLM's state_dict (PyTorch layout, float32)
  softmax/<parameter name>               the shared LM softmax
  optimizer/state/<param index>/<key>    optimizer state tensors (Adam: step, exp_avg, exp_avg_sq)
  rng/torch                              torch's CPU generator state (uint8) for dropout
  attrs["meta"]                          JSON: step, epoch, batch position, optimizer param_groups, options, ...,
                                         and "sha256": each group's digest (group_digest), checked as it is loaded
Loading reads arrays and JSON only: nothing is unpickled.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import h5py
import numpy as np
import torch

from elmo_pipeline.fsio import regular_file, replacing


def _put(group: h5py.Group, name: str, t: torch.Tensor) -> None:
    group[name] = t.detach().cpu().numpy()


def save_checkpoint(path: str, model: torch.nn.Module, softmax: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Write atomically (fsio.replacing: a temporary file, then a rename)."""
    opt = optimizer.state_dict()
    groups = {prefix: {name: t.detach().cpu() for name, t in module.state_dict().items()}
              for prefix, module in (("model", model), ("softmax", softmax))}
    groups["optimizer/state"] = {f"{idx}/{key}": value.detach().cpu() if torch.is_tensor(value) else torch.tensor(value)
                                 for idx, state in opt["state"].items() for key, value in state.items()}
    groups["rng"] = {"torch": torch.get_rng_state()}
    with replacing(path, files_only=True) as tmp, h5py.File(tmp, "w") as f:
        for prefix, tensors in groups.items():
            g = f.create_group(prefix)
            for name, t in tensors.items():
                _put(g, name, t)
        f.attrs["meta"] = json.dumps({**meta, "param_groups": opt["param_groups"],
                                      "sha256": {prefix: group_digest(t) for prefix, t in groups.items()}})


def group_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a group's tensors in name order: each name, dtype, shape and bytes (what loading checks)."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name].numpy())
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def tokens_digest(tokens: list[str]) -> str:
    """SHA-256 of a vocabulary's tokens in order: the run's vocab.txt, recorded in its checkpoints ("vocab_sha256")."""
    import hashlib
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def check_vocab(path: str, meta: dict, tokens: list[str], where: str) -> None:
    """ValueError unless the vocabulary read from `where` is the one checkpoint `path` recorded (where it records
    one: a checkpoint of an earlier version does not)."""
    recorded = meta.get("vocab_sha256")
    if recorded is not None and tokens_digest(tokens) != recorded:
        raise ValueError(f"{where}: not the vocabulary {path} was trained with (its SHA-256 differs): a vocab.txt "
                         "changed or swapped since")


def _checked(path: str, meta: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tensors (group `prefix` as read) when they are what the checkpoint recorded (meta["sha256"], where it has
    one: a checkpoint of an earlier version has none); ValueError naming the file otherwise."""
    recorded = meta.get("sha256")
    if isinstance(recorded, dict) and prefix in recorded and group_digest(tensors) != recorded[prefix]:
        raise ValueError(f"{path}: its {prefix} arrays are not the ones it recorded (SHA-256 differs): a damaged "
                         "checkpoint")
    return tensors


def read_meta(path: str) -> dict:
    """The checkpoint's meta (a JSON object); ValueError naming the file when it is no readable checkpoint."""
    regular_file(path)              # a FIFO's open would block, a device's read never end
    with _readable(path), h5py.File(path, "r") as f:
        return _meta(f, ("step", "options"))


@contextmanager
def _readable(path: str):
    """h5py's and the JSON parser's failures on a damaged or foreign file as one ValueError naming it."""
    try:
        yield
    except (OSError, KeyError, json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None


def _meta(f: h5py.File, keys: tuple[str, ...] = ()) -> dict:
    """The file's meta attribute, a JSON object holding `keys`; KeyError otherwise."""
    meta = json.loads(f.attrs["meta"])
    if not isinstance(meta, dict) or not all(k in meta for k in keys):
        raise KeyError(f"its meta is no object holding {', '.join(keys) or 'anything'}")
    counts = [k for k in ("step", "total_steps", "epoch", "tokens", "seed") if k in meta]
    if any(type(meta[k]) is not int or meta[k] < 0 for k in counts) or not isinstance(meta.get("options", {}), dict):
        raise TypeError("its meta's step, total_steps, epoch, tokens or seed is no count, or its options no object")
    return meta


def read_tensors(group: h5py.Group, expected: dict[str, tuple] | None = None, limit: int = 0) -> dict[str, torch.Tensor]:
    """Each dataset of `group` as a tensor, read only once it is what the caller expects: its name and shape in
    `expected` (a module's state_dict), else (None) at most `limit` elements; ValueError naming it otherwise, and
    for data kept outside the file. A damaged or foreign checkpoint never allocates beyond the model's size."""
    out, where = {}, f"{group.file.filename}:{group.name}"

    def take(name: str, obj) -> None:
        if not isinstance(obj, h5py.Dataset):
            return
        shape = tuple(obj.shape or ())
        if expected is not None and expected.get(name) != shape or expected is None and np.prod(shape) > limit:
            raise ValueError(f"{where}/{name}: a dataset of shape {shape}, not the model's "
                             f"{expected.get(name) if expected is not None else f'(at most {limit} values)'}")
        if obj.external or obj.is_virtual:
            raise ValueError(f"{where}/{name}: keeps its data outside the file")
        out[name] = torch.from_numpy(np.asarray(obj[()]))
    group.visititems(take)
    return out


def shapes_of(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def load_checkpoint(path: str, model: torch.nn.Module, softmax: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True) -> dict:
    """Restore everything saved by save_checkpoint into the given objects; returns the meta dict."""
    regular_file(path)
    with _readable(path), h5py.File(path, "r") as f:
        meta = _meta(f)
        model.load_state_dict(_checked(path, meta, "model", read_tensors(f["model"], shapes_of(model))))
        softmax.load_state_dict(_checked(path, meta, "softmax", read_tensors(f["softmax"], shapes_of(softmax))))
        if optimizer is not None:
            state: dict[int, dict] = {}
            if "optimizer/state" in f:           # each a parameter's moments (or a step count): no larger
                largest = max((p.numel() for m in (model, softmax) for p in m.parameters()), default=1)
                tensors = _checked(path, meta, "optimizer/state", read_tensors(f["optimizer/state"], limit=largest))
                for name, t in tensors.items():
                    idx, key = name.split("/")
                    state.setdefault(int(idx), {})[key] = t
            optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        if restore_rng:               # the generator's state: its shape checked before it is read
            rng = _checked(path, meta, "rng", read_tensors(f["rng"], {"torch": tuple(torch.get_rng_state().shape)}))
            torch.set_rng_state(rng["torch"])
    return meta
