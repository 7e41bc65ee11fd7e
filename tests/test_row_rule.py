"""The row rule of model/row_tile.py: the row counts a batch-invariant GEMM is called with, each checked on first use,
and the invariant path calling its GEMMs in those pieces."""
import pytest
import torch

from elmo_pipeline.model import row_tile
from elmo_pipeline.model.row_tile import (MAX_ROWS, PROBES, ROW_TILE, RowRule, check_pair, forget_row_rules, in_pieces,
                                          row_rule, row_rule_of)
from tests.test_batch_invariant import assert_bits_equal, sentences


def _x(rows=32, k=64):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0))


def _rule(name, threads, gemm):
    """A RowRule whose check runs `gemm` (a stand-in for a library op) on check_pair's rows."""
    return RowRule(name, threads, lambda like, dim: (gemm, check_pair(like.shape[-1], 1, like, dim)[1]))


def _sizes(cuts):
    return [b - a for a, b in cuts]


def _check_cuts(cuts, n):
    assert cuts[0][0] == 0 and cuts[-1][1] == n and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert all(0 < s <= MAX_ROWS and s % ROW_TILE == 0 for s in _sizes(cuts))


def test_a_row_independent_gemm_is_called_whole_up_to_max_rows():
    w = _x(16, 64)
    rule = _rule("x @ w.T", 1, lambda r: r @ w.T)
    for n in (4, 36, 184, MAX_ROWS, MAX_ROWS + 4, 3 * MAX_ROWS + 40):
        cuts = rule.cuts(n, _x(8))
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
    rule = _rule("breaks past 32", 1, probe)
    for n in (184, 184, 600):
        cuts = rule.cuts(n, _x(8))
        _check_cuts(cuts, n)
        assert max(_sizes(cuts)) == 32
    assert not rule.kept[36] and rule.kept[32] and all(rule.kept[m] == (m <= 32) for m in rule.kept)
    checked = [m for m in calls if m != ROW_TILE]         # besides the 4-row calls of each check's reference
    assert len(checked) == len(set(checked)) == len(rule.kept) - 1     # the reference made once


def test_a_row_moved_at_any_position_is_caught():
    """Every row of a count's call is compared, not only the first ones: a kernel whose rows past 36 take another
    path at 64 rows and more gives calls of at most 60 rows."""
    w = _x(16, 64)

    def gemm(x):
        y = x @ w.T
        if x.shape[0] >= 64:
            y[36:] = (x[36:, 32:] @ w[:, 32:].T) + (x[36:, :32] @ w[:, :32].T)
        return y
    cuts = _rule("moves rows past 36", 1, gemm).cuts(200, _x(8))
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
        rule = _rule("by threads", 2, by_threads)
        assert torch.equal(in_pieces(by_threads, x[:first], rule), x[:first] @ w.T) and rule.threads == 1
        assert torch.equal(in_pieces(by_threads, x, rule), x @ w.T)
    steady = _rule("steady", 2, lambda r: r @ w.T)
    in_pieces(lambda r: r @ w.T, x[:4], steady)
    assert steady.threads == 2 and steady.kept == {ROW_TILE: True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checks_rows_catch_any_change_of_the_summation_order(dtype):
    """check_pair: the products cancel (0 in real numbers: within float64's rounding), and summing K in four blocks,
    last first, instead of one pass moves most outputs' bits, where random rows and weights move a bf16 output only
    now and then (why a check on random rows kept 36-row calls of the AMX projection that move a row's bits)."""
    like = torch.zeros(8, 4096, dtype=dtype)
    w, x = check_pair(4096, 64, like)
    assert x.shape == (16, 4096) and w.shape == (64, 4096) and x.dtype == w.dtype == dtype
    assert (x.double() @ w.double().T).abs().max() < 1e-6          # partial sums of about 2**15

    def moved(x, w):                    # fp32 sums of bf16 or fp32 products, in one pass or in blocks
        x, w = x.float(), w.float()
        whole = (x @ w.T).to(dtype)
        blocks = sum((x[:, i: i + 1024] @ w[:, i: i + 1024].T) for i in (3072, 2048, 1024, 0)).to(dtype)
        return (whole != blocks).float().mean().item()
    assert moved(x, w) > 0.5
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bfloat16:
        assert moved(torch.randn(16, 4096, generator=g).to(dtype), torch.randn(64, 4096, generator=g).to(dtype)) < 0.05


def test_a_rule_of_an_op_not_known_is_refused():
    with pytest.raises(ValueError, match="no row check for the GEMM op 'conv'"):
        row_rule_of("conv", 64, 16, torch.float32)


def test_counts_off_the_tile_are_refused():
    with pytest.raises(ValueError, match="multiple of"):
        _rule("x", 1, lambda r: r).cuts(6, _x(8))


def test_in_pieces_gives_the_gemm_of_the_whole_in_order(monkeypatch):
    monkeypatch.setattr(row_tile, "MAX_ROWS", 24)
    w = _x(16, 64)
    x = _x(300, 64)[:296]
    gemm = lambda rows: rows @ w.T                                       # noqa: E731
    rule = _rule("x @ w.T", torch.get_num_threads(), gemm)
    assert torch.allclose(in_pieces(gemm, x, rule), x @ w.T)
    out = torch.empty(296, 16)
    assert in_pieces(gemm, x, rule, out=out) is out and torch.allclose(out, x @ w.T)
    both = torch.stack([x, 2 * x])                                       # rows along dim 1, as the bmm loop's
    assert torch.allclose(in_pieces(lambda r: r @ w.T, both, _rule("bmm", 1, lambda r: r @ w.T), dim=1), both @ w.T)


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
    """The check runs each library op the invariant path calls (PROBES: oneDNN's linear with a post-op where this
    torch has it for the dtype, torch.mm, F.linear, bmm, addmm_ per direction), on weights and rows of its own, and
    cuts 600 rows into valid calls; whether the path's own calls go through it:
    test_the_invariant_path_in_small_pieces_gives_the_same_bits."""
    ops = {"linear": (), "mm": (), "bmm": (), "addmm": ()}
    if torch.backends.mkldnn.is_available() and (dtype == torch.float32
                                                 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        ops.update({"onednn": ("sigmoid", "bias")})
    assert set(ops) <= set(PROBES)
    forget_row_rules()
    for op, post in ops.items():
        dim = 1 if op in ("bmm", "addmm") else 0
        like = torch.zeros(2, 8, 96, dtype=dtype) if dim else torch.zeros(8, 96, dtype=dtype)
        for threads in (1, 2):
            rule = row_rule_of(op, 96, 40, dtype, *post, threads=threads)
            _check_cuts(rule.cuts(600, like, dim), 600)
            assert rule.threads in (1, threads) and rule.kept[ROW_TILE]


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


def test_the_sigmoid_probe_catches_a_change_of_the_summation_order_in_bfloat16(monkeypatch):
    """The gates' probe (oneDNN with a sigmoid and a bias) in bf16: with a zero bias its outputs all round to about
    0.5 whatever the order of the sums, so a kernel that sums K in blocks past 4 rows was kept."""
    def linear(x, w, b, act, scalars, algo):        # a stand-in whose k-sum order changes past 4 rows
        xf, wf = x.float(), w.float()
        y = xf @ wf.T if x.shape[0] <= ROW_TILE else sum(xf[:, i: i + 4] @ wf[:, i: i + 4].T for i in (12, 8, 4, 0))
        return torch.sigmoid(y + b.float()).to(x.dtype)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w: w)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", linear)
    forget_row_rules()
    rule = row_rule_of("onednn", 16, 256, torch.bfloat16, "sigmoid", "bias", threads=1)
    assert rule.cuts(16, torch.zeros(16, 16, dtype=torch.bfloat16)) == [(i, i + ROW_TILE) for i in range(0, 16, 4)]
    forget_row_rules()
