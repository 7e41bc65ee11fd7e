"""The LSTM loop's two GEMM implementations (model/bilm.py LSTM_GEMMS) and the fused cell a GPU compiles."""
import pytest
import torch

import model.bilm as bilm
from model.char_ids import batch_char_ids
from model.synthetic import random_bilm
from tests.oracle import oracle_forward
from tests.test_batch_invariant import sentences


def _batch(n=9, seed=2):
    return (torch.from_numpy(a) for a in batch_char_ids(sentences(n, seed=seed, max_len=18)))


@pytest.mark.parametrize("gemm", ["onednn", "bmm"])
def test_each_loop_equals_the_oracle(monkeypatch, gemm):
    """Both loops, forced, give the oracle's vectors and final states (lengths vary: sequences end mid-batch)."""
    if gemm == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(bilm, "LSTM_GEMM", gemm)
    model = random_bilm("tiny", seed=4)
    ids, lengths = _batch()
    ref, (rh, rc) = oracle_forward(model, ids, lengths, None)
    with torch.inference_mode():
        got, (h, c) = model(ids, lengths)
    assert bilm.lstm_gemm(torch.device("cpu"), torch.float32) == gemm
    assert (got - ref).abs().max() <= 1e-5
    assert (h - rh).abs().max() <= 1e-5 and (c - rc).abs().max() <= 1e-5


def test_auto_choice():
    """auto: oneDNN on a CPU whose torch has it (for the dtype), the bmm loop on a GPU."""
    assert bilm.lstm_gemm(torch.device("cuda"), torch.float32) == "bmm"
    want = "onednn" if torch.backends.mkldnn.is_available() else "bmm"
    assert bilm.lstm_gemm(torch.device("cpu"), torch.float32) == want


def test_weights_follow_the_choice(monkeypatch):
    """The cached weights are re-made in the other form when the choice changes."""
    model = random_bilm("tiny", seed=4)
    monkeypatch.setattr(bilm, "LSTM_GEMM", "bmm")
    assert isinstance(model._pair_weights(0), tuple)
    if torch.backends.mkldnn.is_available():
        monkeypatch.setattr(bilm, "LSTM_GEMM", "onednn")
        assert isinstance(model._pair_weights(0), list)


def test_bad_choice_is_an_error(monkeypatch):
    monkeypatch.setattr(bilm, "LSTM_GEMM", "cublas")
    with pytest.raises(ValueError, match="ELMO_LSTM_GEMM"):
        bilm.lstm_gemm(torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_fused_cell_compiles_to_one_graph_and_equals_the_eager_cell():
    """What a GPU runs (torch.compile of _cell_fused, here with inductor's CPU code): one graph (fullgraph),
    one compilation for every row count (dynamic), the eager cell's values to float rounding."""
    fused = torch.compile(bilm._cell_fused, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for n in (3, 8, 13):
        gates = torch.randn(2, n, 4 * 16, generator=g) * 3
        c = torch.randn(2, n, 16, generator=g) * 3
        want_c, want_out = bilm._cell_eager(gates.clone(), c.clone(), 3.0, torch.empty(2, n, 16))
        got_c, got_out = fused(gates, c, 3.0, torch.empty(2, n, 16))
        assert (got_c - want_c).abs().max() <= 1e-6 and (got_out - want_out).abs().max() <= 1e-6
        assert got_c.abs().max() <= 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_step_gemms_keep_a_rows_bits_for_every_multiple_of_row_tile(dtype):
    """What --batch-invariant relies on in the oneDNN loop: the step GEMMs of the original shape (gates with sigmoid,
    gate j with tanh, the projection with its clip) give a row the same bits for every row count that is a multiple
    of ROW_TILE, at any row position, at 1 thread and at this process's thread count (docs/exactness.md)."""
    if not torch.backends.mkldnn.is_available() or (dtype == torch.bfloat16
                                                    and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("no oneDNN for this dtype in this torch build")
    linear, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            for k, n, attr, scalars in ((1024, 12288, "sigmoid", []), (1024, 4096, "tanh", []),
                                        (4096, 512, "hardtanh", [-3.0, 3.0])):
                w = reorder((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype))
                b = torch.randn(n, generator=g).to(dtype)
                x = torch.randn(132, k, generator=g).to(dtype)
                ref = linear(x[:4], w, b, attr, scalars, "")
                for m in range(bilm.ROW_TILE, 133, bilm.ROW_TILE):
                    assert torch.equal(linear(x[:m], w, b, attr, scalars, "")[:4], ref), (n_threads, k, n, m)
                moved = linear(torch.cat([x[4:8], x[:4]]), w, b, attr, scalars, "")[4:]    # rows at another position
                assert torch.equal(moved, ref)
    finally:
        torch.set_num_threads(threads)


def test_profile_counts_the_onednn_linears_by_rows():
    """benchmarks.model_speed --profile: each oneDNN linear lands in its rows bucket with its FLOPs."""
    from benchmarks.model_speed import profile_shares

    w = torch.ops.mkldnn._reorder_linear_weight(torch.rand(48, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for m in (3, 40, 40, 63, 64):
            torch.ops.mkldnn._linear_pointwise(torch.rand(m, 32), w, None, "none", [], "")
    rows = {r["rows"]: r for r in profile_shares(prof)["linear_by_rows"]}
    assert {k: r["calls"] for k, r in rows.items()} == {"2-3": 1, "32-63": 3, "64-127": 1}
    r = rows["32-63"]
    assert abs(r["gflops"] * r["seconds"] * 1e9 - 2 * (40 + 40 + 63) * 32 * 48) < 1
