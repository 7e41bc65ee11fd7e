"""Training checkpoints as plain HDF5: tensors as datasets, everything else as one JSON attribute.

Layout of a checkpoint file:
  model/<parameter name>                 the BiLM's state_dict (PyTorch layout, float32)
  softmax/<parameter name>               the shared LM softmax
  optimizer/state/<param index>/<key>    optimizer state tensors (Adam: step, exp_avg, exp_avg_sq)
  rng/torch                              torch's CPU generator state (uint8) for dropout
  attrs["meta"]                          JSON: step, epoch, batch position, optimizer param_groups, options, ...
Loading reads arrays and JSON only: nothing is unpickled.
"""
from __future__ import annotations

import json

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
    with replacing(path, files_only=True) as tmp, h5py.File(tmp, "w") as f:
        for prefix, module in (("model", model), ("softmax", softmax)):
            g = f.create_group(prefix)
            for name, t in module.state_dict().items():
                _put(g, name, t)
        g = f.create_group("optimizer/state")
        for idx, state in opt["state"].items():
            for key, value in state.items():
                _put(g, f"{idx}/{key}", value if torch.is_tensor(value) else torch.tensor(value))
        f["rng/torch"] = torch.get_rng_state().numpy()
        f.attrs["meta"] = json.dumps({**meta, "param_groups": opt["param_groups"]})


def read_meta(path: str) -> dict:
    regular_file(path)              # a FIFO's open would block, a device's read never end
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["meta"])


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
    with h5py.File(path, "r") as f:
        meta = json.loads(f.attrs["meta"])
        model.load_state_dict(read_tensors(f["model"], shapes_of(model)))
        softmax.load_state_dict(read_tensors(f["softmax"], shapes_of(softmax)))
        if optimizer is not None:
            state: dict[int, dict] = {}
            if "optimizer/state" in f:           # each a parameter's moments (or a step count): no larger
                largest = max((p.numel() for m in (model, softmax) for p in m.parameters()), default=1)
                for name, t in read_tensors(f["optimizer/state"], limit=largest).items():
                    idx, key = name.split("/")
                    state.setdefault(int(idx), {})[key] = t
            optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        if restore_rng:               # the generator's state: its shape checked before it is read
            torch.set_rng_state(read_tensors(f["rng"], {"torch": tuple(torch.get_rng_state().shape)})["torch"])
    return meta
