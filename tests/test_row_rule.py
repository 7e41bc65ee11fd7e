"""The row rule of model/row_tile.py: the row counts a batch-invariant GEMM is called with, each checked on first use,
and the invariant path calling its GEMMs in those pieces."""
import pytest
import torch

from elmo_pipeline.model import row_tile
from elmo_pipeline.model.row_tile import MAX_ROWS, ROW_TILE, RowRule, forget_row_rules, in_pieces, row_rule, row_rule_of
from tests.test_batch_invariant import assert_bits_equal, sentences


def _x(rows=32, k=64):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0))


def _sizes(cuts):
    return [b - a for a, b in cuts]


def _check_cuts(cuts, n):
    assert cuts[0][0] == 0 and cuts[-1][1] == n and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert all(0 < s <= MAX_ROWS and s % ROW_TILE == 0 for s in _sizes(cuts))


def test_a_row_independent_gemm_is_called_whole_up_to_max_rows():
    w = _x(16, 64)
    rule = RowRule("x @ w.T", 1)
    for n in (4, 36, 184, MAX_ROWS, MAX_ROWS + 4, 3 * MAX_ROWS + 40):
        cuts = rule.cuts(n, lambda r: r @ w.T, _x(8))
        _check_cuts(cuts, n)
        assert _sizes(cuts) == [MAX_ROWS] * (n // MAX_ROWS) + ([n % MAX_ROWS] if n % MAX_ROWS else [])
    assert all(rule.kept.values())


def _breaks_past(limit, w):
    """A GEMM whose summation order changes past `limit` rows (as a kernel switch does)."""
    def gemm(x):
        if x.shape[0] <= limit:
            return x @ w.T
        return (x[:, 32:] @ w[:, 32:].T) + (x[:, :32] @ w[:, :32].T)
    return gemm


def test_a_gemm_whose_bits_depend_on_the_row_count_is_cut_below_the_break():
    """A break past 32 rows (as an Intel Xeon with AMX's bf16 projection from 36 rows up): calls of at most 32 rows,
    each count checked once."""
    calls = []
    gemm = _breaks_past(32, _x(16, 64))

    def probe(x):
        calls.append(x.shape[0])
        return gemm(x)
    rule = RowRule("breaks past 32", 1)
    for n in (184, 184, 600):
        cuts = rule.cuts(n, probe, _x(8))
        _check_cuts(cuts, n)
        assert max(_sizes(cuts)) == 32
    assert not rule.kept[36] and rule.kept[32] and all(rule.kept[m] == (m <= 32) for m in rule.kept)
    checked = [m for m in calls if m != ROW_TILE]         # besides the 4-row calls of each check's reference
    assert len(checked) == len(set(checked)) == len(rule.kept) - 1


def test_a_row_moved_at_any_position_is_caught():
    """Every row of a count's call is compared, not only the first ones: a kernel whose rows past 36 take another
    path at 64 rows and more gives calls of at most 60 rows."""
    w = _x(16, 64)

    def gemm(x):
        y = x @ w.T
        if x.shape[0] >= 64:
            y[36:] = (x[36:, 32:] @ w[:, 32:].T) + (x[36:, :32] @ w[:, :32].T)
        return y
    cuts = RowRule("moves rows past 36", 1).cuts(200, gemm, _x(8))
    _check_cuts(cuts, 200)
    assert max(_sizes(cuts)) == 60


def test_a_gemm_whose_bits_depend_on_the_thread_count_runs_at_one_thread():
    """A library that sums the inner dimension in another order at 2 threads (as MKL did on an Intel Xeon): the
    invariant path calls that GEMM at 1 thread, so 1 and 2 torch threads give the same bits."""
    w = _x(16, 64)

    def by_threads(x):
        if torch.get_num_threads() == 1:
            return x @ w.T
        return (x[:, 32:] @ w[:, 32:].T) + (x[:, :32] @ w[:, :32].T)
    x = _x(40)
    for first in (4, 40):                  # the first call of 4 rows (a lane step) is decided as well as a longer one
        rule = RowRule("by threads", 2)
        assert torch.equal(in_pieces(by_threads, x[:first], rule), x[:first] @ w.T) and rule.threads == 1
        assert torch.equal(in_pieces(by_threads, x, rule), x @ w.T)
    steady = RowRule("steady", 2)
    in_pieces(lambda r: r @ w.T, x[:4], steady)
    assert steady.threads == 2 and steady.kept == {ROW_TILE: True}


def test_one_rule_serves_gemms_of_other_weights():
    """The forward and backward directions, and the layers of one width, share a rule: each count is checked against
    the probe's own 4-row bits, so other weights never look like a kernel break."""
    rule = RowRule("shared", 1)
    for seed in range(4):
        w = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
        for n in (8, 16, 24, 100):
            rule.cuts(n, lambda r: r @ w.T, _x(8))
    assert all(rule.kept.values()) and len(rule.kept) > 4


def test_counts_off_the_tile_are_refused():
    with pytest.raises(ValueError, match="multiple of"):
        RowRule("x", 1).cuts(6, lambda r: r, _x(8))


def test_in_pieces_gives_the_gemm_of_the_whole_in_order(monkeypatch):
    monkeypatch.setattr(row_tile, "MAX_ROWS", 24)
    w = _x(16, 64)
    x = _x(300, 64)[:296]
    gemm = lambda rows: rows @ w.T                                       # noqa: E731
    rule = RowRule("x @ w.T", torch.get_num_threads())
    assert torch.allclose(in_pieces(gemm, x, rule), x @ w.T)
    out = torch.empty(296, 16)
    assert in_pieces(gemm, x, rule, out=out) is out and torch.allclose(out, x @ w.T)
    both = torch.stack([x, 2 * x])                                       # rows along dim 1, as the bmm loop's
    assert torch.allclose(in_pieces(lambda r: r @ w.T, both, RowRule("bmm", 1), dim=1), both @ w.T)


def test_one_rule_per_gemm_and_thread_count():
    forget_row_rules()
    a = row_rule_of("onednn", 64, 16, torch.float32, threads=1)
    assert row_rule_of("onednn", 64, 16, torch.float32, threads=1) is a
    assert row_rule_of("onednn", 64, 16, torch.float32, threads=2) is not a
    assert row_rule_of("onednn", 64, 16, torch.bfloat16, threads=1) is not a
    forget_row_rules()
    assert row_rule_of("onednn", 64, 16, torch.float32, threads=1) is not a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_runs_each_kind_of_gemm_here(dtype):
    """The check runs each library op the invariant path calls (oneDNN's linear with a post-op where this torch has it
    for the dtype, torch.mm, F.linear, bmm, addmm_ per direction) and cuts 600 rows into valid calls; whether the
    path's own calls go through it: test_the_invariant_path_in_small_pieces_gives_the_same_bits."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 96, generator=g) / 10).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    both = torch.stack([w.t(), w.t().flip(0)])
    gemms = {"linear": (lambda r: torch.nn.functional.linear(r, w, b), 0),
             "mm": (lambda r: torch.mm(r, w.t().contiguous()), 0),
             "bmm": (lambda r: torch.bmm(r, both), 1),
             "addmm_": (lambda r: torch.stack([r[g, :, :1].expand(-1, 40).contiguous().addmm_(r[g], both[g])
                                               for g in range(2)]), 1)}
    if torch.backends.mkldnn.is_available() and (dtype == torch.float32
                                                 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        gemms["onednn"] = (lambda r: torch.ops.mkldnn._linear_pointwise(r, packed, b, "sigmoid", [], ""), 0)
    for name, (gemm, dim) in gemms.items():
        like = torch.zeros(2, 8, 96, dtype=dtype) if dim else torch.zeros(8, 96, dtype=dtype)
        for threads in (1, 2):
            rule = RowRule(name, threads)
            _check_cuts(rule.cuts(600, gemm, like, dim), 600)
            assert rule.threads in (1, threads)


def test_row_rule_record():
    assert row_rule() == {"row_tile": ROW_TILE}


@pytest.mark.parametrize("loop", ["onednn", "bmm"])
def test_the_invariant_path_in_small_pieces_gives_the_same_bits(loop, monkeypatch):
    """Every GEMM of the batch-invariant path (token encoder, LSTM steps, both loops) cut into calls of at most 8
    rows gives the same vectors as in this process's own pieces: the pieces are put back in place, and a row's bits
    do not depend on them."""
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.synthetic import random_bilm
    if loop == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    sents = sentences(60, seed=5, max_len=30)
    forget_row_rules()

    def run():
        e = ElmoEmbedder(model=random_bilm("tiny", seed=2), batch_invariant=True, lstm_loop=loop)
        return e.embed_batch(sents)
    ref = run()
    keys = set(row_tile._RULES)
    if loop == "onednn":                   # the three step GEMMs: gates (sigmoid), gate j (tanh), the projection
        assert {"sigmoid", "tanh"} <= {k[4] for k in keys if k[0] == "onednn" and len(k) > 5}
    else:
        assert {"bmm", "addmm"} <= {k[0] for k in keys}
    monkeypatch.setattr(row_tile, "MAX_ROWS", 8)
    seen = []
    real = RowRule.cuts
    monkeypatch.setattr(RowRule, "cuts", lambda self, *a, **k: seen.append(real(self, *a, **k)) or seen[-1])
    assert_bits_equal(ref, run(), f"{loop} loop, calls of at most 8 rows vs the process's own")
    assert seen and max(b - a for cuts in seen for a, b in cuts) == 8
