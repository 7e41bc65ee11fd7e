"""biLMs with random weights in the published shapes, written in the bilm-tf file layout.

For tests and benchmarks: `write_random_bilm("small", folder)` gives options.json + weights.hdf5
that load_bilm, AllenNLP and bilm-tf all read. Weight scales keep activations in a realistic range.
"""
from __future__ import annotations

import copy
import json
import os

import torch

from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.options import parse_options

_PUBLISHED_CNN = {"activation": "relu", "embedding": {"dim": 16},
                  "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
                  "max_characters_per_token": 50, "n_characters": 262}
_LSTM = {"cell_clip": 3, "proj_clip": 3, "n_layers": 2, "use_skip_connections": True}

PUBLISHED_OPTIONS = {
    "small": {"lstm": {**_LSTM, "dim": 1024, "projection_dim": 128}, "char_cnn": {**_PUBLISHED_CNN, "n_highway": 1}},
    "medium": {"lstm": {**_LSTM, "dim": 2048, "projection_dim": 256}, "char_cnn": {**_PUBLISHED_CNN, "n_highway": 1}},
    "original": {"lstm": {**_LSTM, "dim": 4096, "projection_dim": 512}, "char_cnn": {**_PUBLISHED_CNN, "n_highway": 2}},
    # a tiny model with skip connections, for fast tests
    "tiny": {"lstm": {**_LSTM, "dim": 32, "projection_dim": 8},
             "char_cnn": {**_PUBLISHED_CNN, "embedding": {"dim": 4}, "filters": [[1, 4], [2, 8], [3, 8]], "n_highway": 1}},
}


def random_bilm(options: dict | str, seed: int = 0) -> BiLM:
    """A BiLM with seeded random weights; `options` is a dict or a PUBLISHED_OPTIONS name."""
    raw = copy.deepcopy(PUBLISHED_OPTIONS[options] if isinstance(options, str) else options)
    model = BiLM(parse_options(raw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            scale = 1.0 if "char_embed" in name else (0.1 if p.dim() == 1 else 1.0 / fan_in ** 0.5)
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * scale)
        if model.opts.char_cnn is not None:
            model.token_encoder.char_embed.weight[0].zero_()
    return model.eval()


def write_random_bilm(options: dict | str, folder: str, seed: int = 0) -> tuple[str, str]:
    """Write options.json + weights.hdf5 of a random biLM into `folder`; returns their paths."""
    from elmo_pipeline.model.weights import save_bilm
    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, "options.json"), os.path.join(folder, "weights.hdf5")
    save_bilm(random_bilm(options, seed), *paths)
    return paths


if __name__ == "__main__":  # python -m elmo_pipeline.model.synthetic NAME FOLDER
    import sys
    print(json.dumps(write_random_bilm(sys.argv[1], sys.argv[2])))
