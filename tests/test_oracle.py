"""The fast biLM path equals the plain oracle (model/oracle.py) within 1e-5 in float32."""
import json

import numpy as np
import pytest
import torch

from model.char_ids import batch_char_ids
from model.oracle import oracle_forward
from model.synthetic import PUBLISHED_OPTIONS, random_bilm

WORDS = "the a cat dog sat on mat , . 1998 Zürich 東京 supercalifragilisticexpialidocious-and-then-some-more-letters".split()


def _batch(seed, n=9):
    rng = np.random.default_rng(seed)
    sents = [list(rng.choice(WORDS, size=int(rng.integers(0, 15)))) for _ in range(n)]
    ids, lengths = batch_char_ids(sents)
    return torch.from_numpy(ids), torch.from_numpy(lengths)


@pytest.mark.parametrize("skip", [True, False])
def test_fast_path_equals_oracle(skip):
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    raw["lstm"]["use_skip_connections"] = skip
    model = random_bilm(raw, seed=7)
    state = None
    ostate = None
    for seed in range(3):                      # three consecutive batches, state carried
        ids, lengths = _batch(seed)
        with torch.no_grad():
            fast, state = model(ids, lengths, state)
        ref, ostate = oracle_forward(model, ids, lengths, ostate)
        assert (fast - ref).abs().max() <= 1e-5
        for a, b in zip(state, ostate):
            assert (a - b).abs().max() <= 1e-5
