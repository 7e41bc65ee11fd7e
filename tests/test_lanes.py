"""Lanes (model.batching.pack_lanes, model.packing.PackedBatch(lanes=True)): a batch's sentences laid end to end in
the LSTMs' lanes, each starting from the initial state again. Every sentence gets the oracle's vectors; with
batch_invariant the same bits as without lanes; both GEMM loops; batches cut by token slots."""
import os
import random

import numpy as np
import pytest
import torch

from elmo_pipeline.model.batching import pack_lanes, padding, plan_batches
from elmo_pipeline.model.char_ids import batch_char_ids
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.model.synthetic import random_bilm
from tests.conftest import needs_invariant_device
from tests.oracle import oracle_forward
from tests.test_batch_invariant import sentences

# oneDNN's loop is the CPU's: where ELMO_TEST_DEVICE puts the embedders on a GPU (benchmarks/gpu_check.py), bmm only
GEMMS = ["onednn", "bmm"] if torch.backends.mkldnn.is_available() and \
    os.environ.get("ELMO_TEST_DEVICE", "cpu") == "cpu" else ["bmm"]


def _check_lanes(lengths, capacity):
    lane, start = pack_lanes(lengths, capacity)
    by_lane: dict[int, list[tuple[int, int]]] = {}
    for i, (k, s) in enumerate(zip(lane, start)):
        by_lane.setdefault(k, []).append((s, lengths[i]))
    for k, spans in by_lane.items():
        spans.sort()
        at = 0
        for s, n in spans:          # end to end, no gap, no overlap
            assert s == at
            at += n
        assert at <= capacity or len(spans) == 1     # only a sentence over capacity overflows, alone
    assert sorted(by_lane) == list(range(len(by_lane)))
    return lane, start


def test_pack_lanes_places_every_sentence_end_to_end_within_capacity():
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(0, 60) for _ in range(rng.randint(0, 200))]
        capacity = max(lengths, default=0) + rng.randint(0, 10)
        lane, _ = _check_lanes(lengths, capacity)
        if lengths and capacity:
            # worst fit decreasing: never more lanes than twice the lower bound (a lane under half full
            # would have taken any later sentence, and they come shortest last)
            assert max(lane) + 1 <= max(1, 2 * -(-sum(lengths) // capacity))
    assert pack_lanes([], 10) == ([], [])
    lane, _ = _check_lanes([5, 30, 5], 10)
    assert lane[1] not in (lane[0], lane[2])            # over capacity: a lane of its own


def test_pack_lanes_fills_lanes():
    """Worst fit decreasing on a batch like the embedder's (lengths 3..40 slots, capacity the longest): the lanes'
    slots are at least 90 % used, so nearly every lane runs at nearly every step."""
    rng = random.Random(1)
    lengths = [rng.randint(3, 40) for _ in range(300)]
    lane, start = pack_lanes(lengths, 40)
    ends = {}
    for k, s, n in zip(lane, start, lengths):
        ends[k] = max(ends.get(k, 0), s + n)
    assert sum(lengths) / (len(ends) * 40) >= 0.9        # slots used of the lanes' slots


def test_plan_batches_with_lanes_counts_token_slots():
    lengths = [1, 50, 3, 3, 7, 200, 2] * 20
    for budget in (64, 300, 1000):
        batches = plan_batches(lengths, budget, lanes=True)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert sum(lengths[i] + 2 for i in b) <= budget or len(b) == 1
    # token slots fit more sentences than padded slots
    assert len(plan_batches(lengths, 1000, lanes=True)) < len(plan_batches(lengths, 1000))


def test_plan_batches_with_lanes_keeps_the_sorted_order_and_evens_the_batches():
    """The same concatenated order as without lanes (the pipeline writes batches in this order); the fewest
    batches the budget allows (or one more), within one sentence of an even share: no small remainder."""
    rng = random.Random(4)
    lengths = [rng.randint(1, 120) for _ in range(700)]
    batches = plan_batches(lengths, 2048, lanes=True)
    assert [i for b in batches for i in b] == sorted(range(len(lengths)), key=lambda i: lengths[i])
    total = sum(n + 2 for n in lengths)
    fewest = -(-total // 2048)
    assert len(batches) in (fewest, fewest + 1)
    sizes = [sum(lengths[i] + 2 for i in b) for b in batches]
    assert min(sizes) >= total / len(batches) - 2 * 122 and max(sizes) <= 2048


def test_padding_with_lanes():
    assert padding([2, 4]) == (6, 8)
    assert padding([2, 4], lanes=True) == (6, 2 * 6 - 4)        # two lanes of 6 slots (4 + 2 boundaries)
    assert padding([2, 2], lanes=True) == (4, 2 * 4 - 4)        # two full lanes: no padding
    assert padding([1, 1, 4], lanes=True) == (6, 6 * 2 - 6)     # 3+3 share a lane of 6


def _batch(n=40, seed=5, max_len=30):
    return [torch.from_numpy(a) for a in batch_char_ids(sentences(n, seed=seed, max_len=max_len))]


@pytest.mark.parametrize("gemm", GEMMS)
def test_lanes_give_the_oracles_vectors(gemm):
    """Each sentence in a lane of several equals the oracle's run of it alone, from zeros and from a
    nonzero state shared by every sentence (the warm mode's)."""
    model = random_bilm("tiny", seed=4)
    model.lstm_loop = gemm
    ids, lengths = _batch()
    B = len(lengths)
    _, warm = oracle_forward(model, ids[:1], lengths[:1])
    shared = tuple(s.expand(-1, -1, B, -1).contiguous() for s in warm)
    for state in (None, shared):
        ref, _ = oracle_forward(model, ids, lengths, state)
        with torch.inference_mode():
            pb, _ = model.prepare_tokens(*_inputs(ids, lengths), lanes=True)
            got, final = model.forward_tokens(*_inputs(ids, lengths), state, lanes=True)
        assert pb.n_lanes < B and pb.resets          # lanes of several sentences, restarted mid-lane
        assert final is None                       # no per-sentence final state from shared lanes
        want = torch.cat([ref[:, b, 1: int(lengths[b]) - 1] for b in range(B)], dim=1)
        assert (got - want).abs().max() <= 1e-5


def _inputs(ids, lengths):
    """forward_tokens' inputs (distinct char-id rows, index, lengths) for a padded char-id batch."""
    B, T = ids.shape[:2]
    flat = ids.reshape(B * T, -1)
    uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
    index = inverse.view(B, T).clone()
    index[torch.arange(T)[None, :] >= lengths[:, None]] = -1
    return uniq, index, lengths


@needs_invariant_device
@pytest.mark.parametrize("gemm", GEMMS)
def test_lanes_keep_batch_invariant_bits(gemm):
    """batch_invariant: the same bits with and without lanes, and in any batching with lanes."""
    model = random_bilm("tiny", seed=4)
    model.lstm_loop = gemm
    sents = sentences(60, seed=9, max_len=35)
    runs = []
    for lanes, budget in ((False, 4096), (True, 4096), (True, 256), (True, 64)):
        e = ElmoEmbedder(model=model, token_cache=0, batch_invariant=True, lanes=lanes)
        runs.append(list(e.embed_sentences(sents, max_tokens=budget)))
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))


def test_lanes_and_the_fast_path_agree_to_rounding():
    model = random_bilm("tiny", seed=4)
    sents = sentences(60, seed=9, max_len=35)
    a = list(ElmoEmbedder(model=model, token_cache=0, lanes=False).embed_sentences(sents, max_tokens=4096))
    b = list(ElmoEmbedder(model=model, token_cache=0).embed_sentences(sents, max_tokens=4096))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-5


def test_lanes_by_state_mode():
    model = random_bilm("tiny", seed=4)
    assert ElmoEmbedder(model=model).lanes and ElmoEmbedder(model=model, state="warm").lanes
    assert not ElmoEmbedder(model=model, state="stateful").lanes
    with pytest.raises(ValueError, match="lanes need state"):
        ElmoEmbedder(model=model, state="stateful", lanes=True)


def test_without_lanes_the_final_state_is_returned():
    model = random_bilm("tiny", seed=4)
    ids, lengths = _batch(8)
    with torch.inference_mode():
        _, (h, c) = model.forward_tokens(*_inputs(ids, lengths))
        _, (rh, rc) = oracle_forward(model, ids, lengths)
    assert (h - rh).abs().max() <= 1e-5 and (c - rc).abs().max() <= 1e-5
