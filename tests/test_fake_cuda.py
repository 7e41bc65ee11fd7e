"""Every forward path on a fake CUDA device at the original shape (FakeTensorMode; no GPU, no data, no FLOPs):
no device mismatch (FakeTensorDeviceMismatchError), no host sync inside the model (DataDependentOutputException,
DynamicOutputShapeException), and per batch one host-to-device copy in and one device-to-host copy out.
tests/fake_cuda.py holds the harness."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError

from elmo_pipeline.model.char_ids import batch_char_ids, distinct_char_ids
from elmo_pipeline.model.embedder import ElmoEmbedder
from tests.fake_cuda import OpCounter, fake_cuda, fake_model

SENTS = [("The quick brown fox jumps over the lazy dog .".split()),
         ("It was the best of times , it was the worst of times .".split()),
         ["Hello"], ("A much longer sentence that keeps going and going so the batch has ragged lengths .".split())]

# host data, made outside the fake mode (under it, torch.from_numpy gives a fake tensor)
IDS, LENGTHS = (torch.from_numpy(a) for a in batch_char_ids(SENTS))


@pytest.fixture()
def dev():
    with fake_cuda() as d:
        yield d


def embedder(model, **kw) -> ElmoEmbedder:
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=1):
        return ElmoEmbedder(model=model, device=model.w_device, **kw)


def test_harness_catches_sync_and_mismatch(dev):
    """The checks below can fail: a sync and a device mismatch on fake CUDA tensors raise."""
    x = torch.zeros(3, device=dev)
    with pytest.raises(DataDependentOutputException):
        x.sum().item()
    with pytest.raises(FakeTensorDeviceMismatchError):
        x + torch.zeros(3)
    with OpCounter() as n:
        x.cpu()
        torch.zeros(2).to(dev)
    assert (n.h2d, n.d2h) == (1, 1)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_forward(dev, batch_invariant):
    """BiLM.forward (fast and batch-invariant): the caller's char ids on the device, lengths on the host;
    inside the model one copy in (the index maps), and the result's one copy out."""
    model = fake_model("original", dev)
    ids, lengths = IDS, LENGTHS
    with torch.inference_mode():
        model(ids.to(dev), lengths, batch_invariant=batch_invariant)       # weights stacked once
        x = ids.to(dev)
        with OpCounter(model) as n:
            out, (h, c) = model(x, lengths, batch_invariant=batch_invariant)
            out.cpu()
    assert out.device == dev and h.device == dev and c.device == dev
    assert out.shape == (3, 4, ids.shape[1], 1024)
    assert (n.h2d, n.d2h) == (1, 1), n.report()
    assert n.by_region["lstm"] > 0 and n.by_region["encoder"] > 0


def test_batch_invariant_embedder_refused_on_a_gpu(dev):
    """--batch-invariant is refused on CUDA (its bits moved with the batching on an NVIDIA H200: model.device)."""
    with pytest.raises(ValueError, match="CPU only"):
        embedder(fake_model("tiny", dev), state="warm", batch_invariant=True)


@pytest.mark.parametrize("state, batch_invariant", [("stateless", False), ("warm", False), ("stateful", False)])
def test_embedder(dev, state, batch_invariant):
    """ElmoEmbedder.embed_batch (BiLM.forward_tokens, through the token cache): host data in, numpy out,
    exactly one copy each way per batch; cold cache and warm cache alike."""
    model = fake_model("original", dev)
    e = embedder(model, state=state, batch_invariant=batch_invariant)
    e.embed_batch([["Warm", "up"]])                     # weights stacked once (model.lstm.stack_weights)
    for batch in (SENTS[:2], SENTS, SENTS[1:]):       # new tokens, some cached, all cached
        with OpCounter(model) as n:
            out = e.embed_batch(batch)
        assert [o.shape for o in out] == [(3, len(s), 1024) for s in batch]
        assert (n.h2d, n.d2h) == (1, 1), n.report()


@pytest.mark.parametrize("compile_cell", [True, False])
def test_bmm_loop_cell_on_a_gpu(dev, compile_cell):
    """The bmm loop's cell as model.lstm_loops.cell_for picks it for a GPU: the compiled cell counts one launch per
    step and layer; with compile_cell off, the eager cell's 7 ops do."""
    model = fake_model("original", dev)
    model.compile_cell = compile_cell
    with torch.inference_mode():
        model(IDS.to(dev), LENGTHS)                          # weights stacked once
        with OpCounter(model) as n:
            model(IDS.to(dev), LENGTHS)
    steps = max(len(s) for s in SENTS) + 2                   # <S> and </S>
    fused = n.ops["fused LSTM cell (torch.compile)"]
    assert fused == (2 * steps if compile_cell else 0), n.report()
    assert n.ops["sigmoid_"] == (0 if compile_cell else 2 * steps), n.report()


def test_embedder_without_token_cache(dev):
    model = fake_model("original", dev)
    e = embedder(model, token_cache=0)
    e.embed_batch([["Warm", "up"]])
    with OpCounter(model) as n:
        e.embed_batch(SENTS)
    assert (n.h2d, n.d2h) == (1, 1), n.report()


def test_windows(dev):
    """A long sentence in overlapping windows (model/windows.py): one copy each way per sub-batch."""
    from elmo_pipeline.model.windows import embed_long
    model = fake_model("original", dev)
    e = embedder(model)
    e.embed_batch([["Warm", "up"]])
    tokens = [f"w{i % 37}" for i in range(300)]
    with OpCounter(model) as n:
        out = embed_long(e, tokens, window=100, overlap=20, max_tokens=256)
    assert out.shape == (3, 300, 1024)
    assert n.h2d == n.d2h and n.h2d >= 2, n.report()


def test_training_forward(dev):
    """The training forward (the padded path that runs under autograd, model/padded_forward.py: top_layer and
    BiLM.forward with grad enabled): no sync, no mismatch, no copy back. The parameters do not require grad
    here: on a CPU-only torch build the autograd engine aborts the process when it meets a (fake) CUDA tensor
    that needs a graph, so the backward pass is left to `python -m benchmarks.gpu_check` on a real GPU."""
    from elmo_pipeline.model.padded_forward import top_layer
    model = fake_model("original", dev).requires_grad_(False)
    ids, lengths = IDS, LENGTHS
    x = ids.to(dev)
    assert torch.is_grad_enabled()
    with OpCounter(model) as n:
        fwd, bwd = top_layer(model, x, lengths)
        layers, (h, c) = model(x, lengths)
    assert fwd.device == dev and layers.device == dev and h.device == dev
    assert fwd.shape == (4, ids.shape[1], 512) and layers.shape == (3, 4, ids.shape[1], 1024)
    assert n.d2h == 0 and n.by_region["lstm"] == 0 and n.launches > 0, n.report()


def test_char_id_step_runs_no_torch_op():
    """The char-id step (model/char_ids.py) is host work in numpy: no torch op at all."""
    with fake_cuda(), OpCounter() as n:
        uniq, index, lengths = distinct_char_ids(SENTS)
    assert n.launches == 0 and n.views == 0
    assert uniq.dtype == np.int64 and index.shape == (4, max(len(s) for s in SENTS) + 2)


def test_to_host_on_a_cpu():
    """model.device.to_host on the CPU: float32 results are the tensor's own memory (no copy), others float32."""
    from elmo_pipeline.model.device import to_host
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    a = to_host(t)
    assert a.dtype == np.float32 and np.shares_memory(a, t.numpy())
    b = to_host(t.to(torch.bfloat16)[:, 1:])
    assert b.dtype == np.float32 and b.shape == (2, 2) and b.tolist() == [[1, 2], [4, 5]]


@pytest.mark.parametrize("pinned", [True, False])
def test_to_host_one_copy_pinned_or_not(dev, pinned, caplog):
    """model.device.to_host on a GPU: one device-to-host copy, into page-locked memory, or, where that is refused,
    into a new pageable array, with one warning, and page-locked memory not asked for again in the process."""
    from elmo_pipeline.model import device
    t = torch.zeros(3, 4, 8, device=dev, dtype=torch.bfloat16)
    empty, asked = torch.empty, []

    def refusing(*a, **k):
        if k.get("pin_memory"):
            asked.append(1)
            raise RuntimeError("CUDA error: out of memory\nmore")
        return empty(*a, **k)
    with mock.patch.dict(device._PINNED, refused=False), mock.patch("torch.empty", empty if pinned else refusing), \
            caplog.at_level("WARNING", logger="elmo-pipeline.device"):
        for _ in range(2):
            with OpCounter() as n:
                a = device.to_host(t)
            assert (n.h2d, n.d2h) == (0, 1), n.report()
            assert a.shape == (3, 4, 8) and a.dtype == np.float32
    warned = [r.getMessage() for r in caplog.records]
    if pinned:
        assert not warned
    else:
        assert len(asked) == 1 and len(warned) == 1 and "page-locked host memory refused (CUDA error: out of memory)" \
            in warned[0]


@pytest.mark.parametrize("n", [1, 3])
def test_embed_batch_hands_out_copies(n):
    """ElmoEmbedder.embed_batch's arrays are copies, never the batch's block (on a GPU page-locked memory that torch
    reuses), for a one-sentence batch too."""
    from elmo_pipeline.model import embedder as embedder_module
    from elmo_pipeline.model.synthetic import random_bilm
    e = ElmoEmbedder(model=random_bilm("tiny"))
    blocks = []
    real = embedder_module.to_host

    def keeping(t):                 # a contiguous block of the batch's results, as to_host gives on a GPU
        blocks.append(np.ascontiguousarray(real(t)))
        return blocks[-1]
    with mock.patch.object(embedder_module, "to_host", keeping):
        out = e.embed_batch(SENTS[:n])
    assert len(blocks) == 1 and len(out) == n
    assert not any(np.shares_memory(o, blocks[0]) for o in out)
    assert all(o.flags.c_contiguous and o.flags.owndata for o in out)
