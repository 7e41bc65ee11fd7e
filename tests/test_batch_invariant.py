"""batch_invariant=True (stateless and warm modes; off by default): a sentence's float32 vectors are the same bits
(max |diff| exactly 0) alone, in batches of 7 and 64, in reversed order, under token budgets 256 to 16,384,
from the token cache, at 1 and at 2 torch threads (and 1 thread = 2 threads);
within 1e-5 of the oracle; stateful mode untouched.
Pipeline-level checks (budgets, shard SHA-256, two workers, SIGKILL + resume): tests/test_batch_invariant_pipeline.py."""
import contextlib
import json
import random

import numpy as np
import pytest
import torch

from elmo_pipeline.model.char_ids import batch_char_ids, distinct_char_ids
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS, random_bilm
from elmo_pipeline.model.device import check_batch_invariant
from tests.conftest import needs_invariant_device
from tests.oracle import oracle_forward

BUDGETS = (256, 1024, 4096, 16384)


def odd_options() -> dict:
    """Tiny, with widths that are no multiple of the vector length: the highway's and the LSTM gates' rows end in
    scalar tails (n_filters 20, lstm dim 24), two highway layers, and a projection (20 -> 8)."""
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    raw["lstm"]["dim"] = 24
    raw["char_cnn"]["n_highway"] = 2
    return raw


def sentences(n: int, seed: int = 7, max_len: int = 40) -> list[list[str]]:
    """Lengths 1..max_len (1, 2, 3 among them), Zipf-ish repeated words and rare ones."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 14))) for _ in range(400)]
    lens = [1, 2, 3, 1, max_len] + [rng.randint(1, max_len) for _ in range(n - 5)]
    return [[vocab[min(int(rng.paretovariate(1.0)) - 1, 399)] if rng.random() < .6 else rng.choice(vocab)
             for _ in range(L)] for L in lens[:n]]


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def assert_same_across_threads(one: list[np.ndarray], two: list[np.ndarray], what: str) -> None:
    """1 thread = 2 threads, bit for bit: each GEMM of the invariant path gives a row the bits of a 4-row call at 1
    thread, running at 1 thread where the thread count itself would move them (model/row_tile.py RowRule)."""
    assert_bits_equal(one, two, what)


def embedder(options, state="stateless", **kw) -> ElmoEmbedder:
    kw.setdefault("batch_invariant", state != "stateful")
    return ElmoEmbedder(model=random_bilm(options, seed=1), state=state, **kw)


def assert_bits_equal(ref: list[np.ndarray], got: list[np.ndarray], what: str) -> None:
    assert len(ref) == len(got)
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if a.shape != b.shape or a.tobytes() != b.tobytes()]
    worst = max((float(np.abs(ref[i] - got[i]).max()) for i in bad if ref[i].shape == got[i].shape), default=0.0)
    assert not bad, f"{what}: {len(bad)} of {len(ref)} sentences differ (max |diff| {worst:.2e})"


def batchings(e: ElmoEmbedder, sents: list[list[str]]) -> dict[str, list[np.ndarray]]:
    """Every way of batching the same sentences that the acceptance list names, each on a fresh token cache
    except 'cache' (a second pass whose token vectors all come from the cache of the first)."""
    def fresh():
        e.model.enable_token_cache(50_000)
        return e
    out = {"alone": [fresh().embed_sentence(s) for s in sents],
           "batch7": list(fresh().embed_sentences(sents, batch_size=7)),
           "batch64": list(fresh().embed_sentences(sents, batch_size=64)),
           "reversed": list(fresh().embed_sentences(sents[::-1], batch_size=64))[::-1],
           "one batch, no cache": (e.model.enable_token_cache(0), e.embed_batch(sents))[1]}
    for budget in BUDGETS:
        out[f"budget {budget}"] = list(fresh().embed_sentences(sents, max_tokens=budget))
    list(fresh().embed_sentences(sents, batch_size=13))
    out["cache"] = list(e.embed_sentences(sents[::-1], batch_size=64))[::-1]
    return out


@pytest.mark.parametrize("options", ["tiny", "odd"])
@pytest.mark.parametrize("state", ["stateless", "warm"])
@needs_invariant_device
def test_bits_do_not_depend_on_batching(options, state):
    opts = odd_options() if options == "odd" else options
    sents = sentences(40, max_len=30)
    res = {}
    for n in (1, 2):
        with threads(n):
            e = embedder(opts, state)
            assert e.batch_invariant
            res[n] = batchings(e, sents)
            for name, got in res[n].items():
                assert_bits_equal(res[n]["alone"], got, f"{n} thread(s), {name} vs alone")
    assert_same_across_threads(res[1]["alone"], res[2]["alone"], "1 thread vs 2 threads")


@needs_invariant_device
def test_bits_do_not_depend_on_batching_small_shape():
    """The published 'small' shape (P 128, H 1024, 2048 filters): the library's real kernels for these sizes."""
    sents = sentences(24, seed=3, max_len=30)
    res = {}
    for n in (1, 2):
        with threads(n):
            e = embedder("small")
            res[n] = {"alone": [e.embed_sentence(s) for s in sents],
                      "batch7": list(e.embed_sentences(sents, batch_size=7)),
                      "reversed": list(e.embed_sentences(sents[::-1], batch_size=64))[::-1],
                      **{f"budget {b}": list(e.embed_sentences(sents, max_tokens=b)) for b in (256, 16384)}}
            for name, got in res[n].items():
                assert_bits_equal(res[n]["alone"], got, f"small, {n} thread(s), {name} vs alone")
    assert_same_across_threads(res[1]["alone"], res[2]["alone"], "small, 1 thread vs 2 threads")


def test_the_previous_path_does_depend_on_batching():
    """What the switch buys: without it, some sentences come out in other bits in a batch (few ulps). Shown on the
    bmm loop (GPUs, and MKL on CPUs): oneDNN's CPU GEMMs give a row other bits for fewer row counts, so on
    these sentences its fast path happens to agree, which nothing guarantees."""
    sents = sentences(40)
    e = embedder("tiny", batch_invariant=False, lstm_loop="bmm")
    alone = [e.embed_sentence(s) for s in sents]
    batched = e.embed_batch(sents)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(alone, batched))
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone, batched)) < 1e-5


@pytest.mark.parametrize("options", ["tiny", "odd"])
def test_invariant_path_equals_oracle_and_fast_path(options):
    """forward(batch_invariant=True) within 1e-5 of the oracle, outputs and final states (a carried state too),
    and of the fast path; forward_tokens the same numbers as forward."""
    model = random_bilm(odd_options() if options == "odd" else options, seed=5)
    sents = sentences(10, seed=2, max_len=14)
    state = ostate = fstate = None
    with torch.inference_mode():
        for k in range(2):          # two consecutive batches, state carried (as warm mode starts from one)
            ids, lengths = (torch.from_numpy(a) for a in batch_char_ids(sents[5 * k: 5 * k + 5]))
            inv, state = model(ids, lengths, state, batch_invariant=True)
            fast, fstate = model(ids, lengths, fstate)
            ref, ostate = oracle_forward(model, ids, lengths, ostate)
            assert (inv - ref).abs().max() <= 1e-5 and (inv - fast).abs().max() <= 1e-5
            for a, b in zip(state, ostate):
                assert (a - b).abs().max() <= 1e-5
            uniq, index, lens = distinct_char_ids(sents[5 * k: 5 * k + 5], model.opts.max_characters_per_token)
            tok, _ = model.forward_tokens(torch.from_numpy(uniq), torch.from_numpy(index), torch.from_numpy(lens),
                                          None, batch_invariant=True)
            alone, _ = model(ids, lengths, None, batch_invariant=True)
            real = torch.cat([alone[:, b, 1: int(n) - 1] for b, n in enumerate(lengths)], dim=1)
            assert torch.equal(tok, real)


def test_chunked_input_projection_keeps_the_bits(monkeypatch):
    """Input projections a few steps at a time (tiny CHUNK_ELEMENTS): the same bits as one chunk."""
    import elmo_pipeline.model.lstm_loops as lstm_loops
    model = random_bilm("tiny", seed=3)
    model.lstm_loop = "bmm"                            # the chunked loop (GPUs)
    ids, lengths = (torch.from_numpy(a) for a in batch_char_ids(sentences(12, seed=4, max_len=20)))
    with torch.inference_mode():
        ref, _ = model(ids, lengths, batch_invariant=True)
        monkeypatch.setattr(lstm_loops, "CHUNK_ELEMENTS", 2 * 4 * 32 * 8)      # 8 padded rows per chunk
        got, _ = model(ids, lengths, batch_invariant=True)
    assert torch.equal(ref, got)


@needs_invariant_device
def test_token_cache_never_mixes_the_two_paths():
    """One model, both settings: a token cached by one path is not served to the other."""
    model = random_bilm("tiny", seed=1)
    model.enable_token_cache(1000)
    sents = sentences(20)
    fast = ElmoEmbedder(model=model, batch_invariant=False)
    inv = ElmoEmbedder(model=model, batch_invariant=True)
    ref = [ElmoEmbedder(model=random_bilm("tiny", seed=1), batch_invariant=True).embed_sentence(s) for s in sents]
    fast.embed_batch(sents)
    assert_bits_equal(ref, [inv.embed_sentence(s) for s in sents], "after the fast path filled the cache")


@needs_invariant_device
def test_defaults_and_stateful():
    """Off by default (it costs speed: docs/decisions/batch-invariant-cost.md); stateful cannot have it."""
    assert not ElmoEmbedder(model=random_bilm("tiny")).batch_invariant
    assert ElmoEmbedder(model=random_bilm("tiny"), state="warm", batch_invariant=True).batch_invariant
    assert not ElmoEmbedder(model=random_bilm("tiny"), state="stateful").batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        ElmoEmbedder(model=random_bilm("tiny"), state="stateful", batch_invariant=True)


def test_stateful_mode_runs_the_previous_path():
    """Stateful results are exactly the previous path's (fixture parity: tests/test_fixture_parity.py)."""
    sents = sentences(30)
    a = embedder("tiny", "stateful")
    b = embedder("tiny", "stateless", batch_invariant=False)
    assert not a.batch_invariant
    model = b.model
    state = None
    with torch.inference_mode():
        for k in range(0, 30, 10):
            got = a.embed_batch(sents[k: k + 10])
            uniq, index, lens = b.batch_inputs(sents[k: k + 10])
            out, state = model.forward_tokens(uniq, index, lens, state)
            off = np.cumsum([0] + [len(s) for s in sents[k: k + 10]])
            assert_bits_equal([out[:, i:j].cpu().numpy() for i, j in zip(off[:-1], off[1:])], got, "stateful")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["shipped", "original"])
@needs_invariant_device
def test_shipped_model_and_original_shape(which):
    """The shipped model (model/pretrained) and the published original shape (P 512, H 4096, 2 highways):
    alone = one batch = reversed = budget 256 = batches of 7, at 1 and at 2 threads, and 1 thread = 2 threads."""
    sents = sentences(12, seed=9, max_len=20)
    res = {}
    for n in (1, 2):
        with threads(n):
            e = ElmoEmbedder(batch_invariant=True) if which == "shipped" else embedder(which)
            res[n] = [e.embed_sentence(s) for s in sents]
            for name, got in {"batch": e.embed_batch(sents), "reversed": e.embed_batch(sents[::-1])[::-1],
                              "budget 256": list(e.embed_sentences(sents, max_tokens=256)),
                              "batch7": list(e.embed_sentences(sents, batch_size=7))}.items():
                assert_bits_equal(res[n], got, f"{which}, {n} thread(s), {name} vs alone")
    assert_same_across_threads(res[1], res[2], f"{which}, 1 thread vs 2 threads")


def test_refused_where_the_bits_are_not_kept():
    """--batch-invariant on a device whose bits depend on the batching (CUDA: up to 1.2e-6 on an NVIDIA H200) is one
    ValueError naming the reason, never vectors that claim exactness; the CPU keeps it."""
    for device in ("cuda", "cuda:1", 0, 3, torch.device("cuda")):
        with pytest.raises(ValueError, match="CPU only"):
            check_batch_invariant(device)
    for device in ("cpu", -1, torch.device("cpu")):
        check_batch_invariant(device)
