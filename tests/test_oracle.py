"""The fast biLM path equals the plain oracle (tests/oracle.py) within 1e-5 in float32."""
import json

import numpy as np
import pytest
import torch

from elmo_pipeline.model.char_ids import batch_char_ids
from tests.oracle import oracle_forward
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS, random_bilm

WORDS = "the a cat dog sat on mat , . 1998 Zürich 東京 supercalifragilisticexpialidocious-and-then-some-more-letters".split()


def _batch(seed, n=9):
    rng = np.random.default_rng(seed)
    sents = [list(rng.choice(WORDS, size=int(rng.integers(0, 15)))) for _ in range(n)]
    ids, lengths = batch_char_ids(sents)
    return torch.from_numpy(ids), torch.from_numpy(lengths)


@pytest.mark.parametrize("grad", [False, True], ids=["packed", "autograd"])
@pytest.mark.parametrize("skip", [True, False])
def test_fast_path_equals_oracle(skip, grad):
    """Both paths of BiLM.forward: packed in place (no autograd) and padded (model/padded_forward.py, autograd)."""
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    raw["lstm"]["use_skip_connections"] = skip
    model = random_bilm(raw, seed=7)
    state = None
    ostate = None
    for seed in range(3):                      # three consecutive batches, state carried
        ids, lengths = _batch(seed)
        with torch.set_grad_enabled(grad):
            fast, state = model(ids, lengths, state)
        assert fast.requires_grad == grad
        fast, state = fast.detach(), tuple(s.detach() for s in state)
        ref, ostate = oracle_forward(model, ids, lengths, ostate)
        assert (fast - ref).abs().max() <= 1e-5
        for a, b in zip(state, ostate):
            assert (a - b).abs().max() <= 1e-5


def test_chunked_input_projection_equals_oracle(monkeypatch):
    """Input projections computed a few steps at a time."""
    import elmo_pipeline.model.lstm_loops as lstm_loops
    model = random_bilm("tiny", seed=3)
    model.lstm_loop = "bmm"                            # the chunked loop (GPUs)
    ids, lengths = _batch(11, n=12)
    ref, (rh, rc) = oracle_forward(model, ids, lengths, None)
    monkeypatch.setattr(lstm_loops, "CHUNK_ELEMENTS", 2 * 4 * 32 * 5)      # 5 packed rows per chunk
    with torch.no_grad():
        fast, (h, c) = model(ids, lengths)
    assert (fast - ref).abs().max() <= 1e-5
    assert (h - rh).abs().max() <= 1e-5 and (c - rc).abs().max() <= 1e-5


def test_autograd_path_gives_gradients():
    """BiLM.forward under autograd (the padded path): every parameter gets a finite gradient, padded positions
    of every layer stay zero, and a length-0 row keeps its initial state."""
    model = random_bilm("tiny", seed=3)
    ids, lengths = _batch(12, n=6)
    ids[-1], lengths[-1] = 0, 0
    torch.manual_seed(0)
    h0, c0 = (torch.randn_like(s) for s in model.zero_state(len(lengths)))
    out, (h, c) = model(ids, lengths, (h0, c0))
    (out.sum() + h.sum() + c.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    pad = torch.arange(ids.shape[1])[None, :] >= lengths[:, None]
    assert (out.detach()[:, pad] == 0).all()
    assert torch.equal(h[:, :, -1], h0[:, :, -1]) and torch.equal(c[:, :, -1], c0[:, :, -1])


def test_reused_workspace_across_modes_and_sizes(monkeypatch):
    """The per-thread gate buffer (model/lstm_loops.py: _workspace) is reused across calls: a small batch,
    then a larger one (the buffer grows), under inference_mode and then no_grad, all equal the oracle."""
    import elmo_pipeline.model.lstm_loops as lstm_loops
    model = random_bilm("tiny", seed=5)
    model.lstm_loop = "bmm"                            # the chunked loop (GPUs)
    monkeypatch.setattr(lstm_loops, "CHUNK_ELEMENTS", 2 * 4 * 32 * 7)      # several chunks per layer
    for seed, n, mode in ((21, 3, torch.inference_mode), (22, 14, torch.inference_mode), (23, 9, torch.no_grad)):
        ids, lengths = _batch(seed, n=n)
        ref, _ = oracle_forward(model, ids, lengths, None)
        with mode():
            fast, _ = model(ids, lengths)
        assert (fast - ref).abs().max() <= 1e-5


def test_bfloat16_model_runs_within_1e2_of_float32_per_layer():
    """The low-precision path a GPU run uses (weights and activations in bf16), here on the CPU:
    per output layer, ||y_bf16 - y_fp32|| / ||y_fp32|| <= 1e-2 (benchmarks/model_speed.py measures the same)."""
    ids, lengths = _batch(31, n=12)
    ref, low = random_bilm("small", seed=9), random_bilm("small", seed=9).to(torch.bfloat16)   # a published shape
    with torch.inference_mode():
        a, b = ref(ids, lengths)[0].double(), low(ids, lengths)[0].double()
    rel = ((b - a) ** 2).sum(dim=(1, 2, 3)).sqrt() / (a ** 2).sum(dim=(1, 2, 3)).sqrt()
    assert low.forward_layers[0].w_rec.dtype == torch.bfloat16
    assert 0 < rel.max() <= 1e-2, rel


def test_char_cnn_gemm_path_equals_conv_path(monkeypatch):
    """Inference runs the char CNN as GEMMs over unfolded windows, in chunks of tokens; autograd runs
    nn.Conv1d. Both give the same token vectors (relu and tanh activations)."""
    import elmo_pipeline.model.encoders as encoders
    monkeypatch.setattr(encoders, "CNN_CHUNK", 3)                        # several chunks, a ragged last one
    monkeypatch.setattr(encoders, "CNN_CHUNK_ONEDNN", 3)                 # (the chunks where oneDNN runs the GEMMs)
    ids, _ = _batch(41, n=6)
    flat = ids.reshape(-1, ids.shape[-1])[:17]
    for activation in ("relu", "tanh"):
        raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
        raw["char_cnn"]["activation"] = activation
        enc = random_bilm(raw, seed=2).token_encoder
        with torch.no_grad():
            fast = enc(flat)
        with torch.enable_grad():
            ref = enc(flat).detach()
        assert fast.shape == ref.shape and (fast - ref).abs().max() <= 1e-5


def test_forward_tokens_equals_forward_bit_for_bit(tiny_model_files):
    """BiLM.forward_tokens (what the embedder and the pipeline run: real tokens only, no padded output) gives
    exactly forward()'s vectors at the real positions, and the same final state."""
    import torch

    from elmo_pipeline.model.char_ids import batch_char_ids, distinct_char_ids
    from elmo_pipeline.model.weights import load_bilm
    model = load_bilm(*tiny_model_files).eval()
    sents = [["The", "cat", "sat", "."], ["A"], [], ["long", "er", "sentence", "here", "with", "é", "😀"]]
    ids, lengths = batch_char_ids(sents)
    uniq, index, _ = distinct_char_ids(sents)
    with torch.inference_mode():
        padded, (h, c) = model(torch.from_numpy(ids), torch.from_numpy(lengths))
        packed, (h2, c2) = model.forward_tokens(torch.from_numpy(uniq), torch.from_numpy(index),
                                                torch.from_numpy(lengths))
    expect = torch.cat([padded[:, b, 1: len(s) + 1] for b, s in enumerate(sents)], dim=1)
    assert torch.equal(packed, expect) and torch.equal(h, h2) and torch.equal(c, c2)
    for layers in ([2], [0, 2], [1], [0, 1, 2]):     # only these copied out: the same bits, layer by layer
        for inv in (False, True):
            with torch.inference_mode():
                full, _ = model.forward_tokens(torch.from_numpy(uniq), torch.from_numpy(index),
                                               torch.from_numpy(lengths), batch_invariant=inv)
                some, _ = model.forward_tokens(torch.from_numpy(uniq), torch.from_numpy(index),
                                               torch.from_numpy(lengths), batch_invariant=inv, layers=layers)
            assert some.shape[0] == len(layers) and torch.equal(some, full[layers])
