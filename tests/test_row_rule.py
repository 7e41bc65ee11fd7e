"""The row-rule check of model/row_tile.py on real pure GEMM callables."""
import pytest
import torch

from elmo_pipeline.model.row_tile import (ROW_TILE, first_rows_keep_their_bits, row_rule, row_rule_breaks,
                                          row_rule_error)


def _x(rows=32, k=64):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0))


def test_a_row_independent_gemm_passes():
    w = _x(16, 64)
    assert first_rows_keep_their_bits(lambda x: x @ w.T, _x()) == []


def test_a_gemm_whose_bits_depend_on_row_count_is_caught():
    """A reduction whose order changes past 16 rows (as a kernel switch does): the check names those counts."""
    w = _x(16, 64)

    def gemm(x):
        if x.shape[0] <= 16:
            return x @ w.T
        return (x[:, 32:] @ w[:, 32:].T) + (x[:, :32] @ w[:, :32].T)   # another summation order

    bad = first_rows_keep_their_bits(gemm, _x())
    assert bad and min(bad) > 16 and all(m % ROW_TILE == 0 for m in bad)


def test_row_rule_record():
    assert row_rule() == {"row_tile": ROW_TILE}


def test_breaks_found_by_the_check_become_a_one_line_refusal():
    """What check_batch_invariant raises when the check finds a row count with other bits."""
    w = _x(16, 64)

    def gemm(x):
        return x @ w.T if x.shape[0] <= 16 else (x[:, 32:] @ w[:, 32:].T) + (x[:, :32] @ w[:, :32].T)

    breaks = tuple((64, 16, m) for m in first_rows_keep_their_bits(gemm, _x()))
    error = row_rule_error(breaks, torch.bfloat16)
    assert "\n" not in error and "bfloat16" in error and f"at {breaks[0][2]} rows" in error
    assert row_rule_error((), torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_this_cpu_passes_the_check_or_refuses(dtype, tiny_model_files):
    """The real property here: a model's step GEMMs keep the rule at this process's threads in each loop, or
    check_row_rule refuses (and so does a batch-invariant embedder)."""
    from elmo_pipeline.model import ElmoEmbedder
    from elmo_pipeline.model.kernels import check_row_rule
    from elmo_pipeline.model.options import load_options
    from elmo_pipeline.model.row_tile import step_gemms
    opts = load_options(tiny_model_files[0])
    breaks = [row_rule_breaks(dtype, torch.get_num_threads(), step_gemms(opts, loop), loop) for loop in ("onednn", "bmm")]
    for loop, found in zip(("onednn", "bmm"), breaks):
        if found:
            with pytest.raises(ValueError, match="cannot keep a row's bits"):
                ElmoEmbedder(*tiny_model_files, batch_invariant=True, dtype=dtype, lstm_loop=loop)
        else:
            check_row_rule("cpu", dtype, opts=opts)
            ElmoEmbedder(*tiny_model_files, batch_invariant=True, dtype=dtype, lstm_loop=loop)


def test_the_encoder_gemms_are_those_the_model_runs(tiny_model_files):
    """encoder_gemms names each GEMM the char-CNN encoder runs on padded tokens, (K, N) from the model's own weights:
    a filter width's unfolded windows, the highways, the projection."""
    from elmo_pipeline.model.row_tile import encoder_gemms
    from elmo_pipeline.model.weights import load_bilm
    model = load_bilm(*tiny_model_files)
    enc = model.token_encoder
    want = {(c.weight.shape[1] * c.weight.shape[2], c.weight.shape[0]) for c in enc.convs}
    want |= {tuple(hw.linear.weight.shape[::-1]) for hw in enc.highways}
    want |= {tuple(enc.proj.weight.shape[::-1])} if enc.proj is not None else set()
    assert {(k, n) for k, n, _, _ in encoder_gemms(model.opts)} == want


def test_a_break_in_an_encoder_gemm_refuses_batch_invariance(tiny_model_files, monkeypatch):
    """check_row_rule checks the token encoder's GEMMs beside the LSTM's: a row count that moves a row's bits in one
    of them is a one-line refusal naming it."""
    from elmo_pipeline.model import kernels, row_tile
    from elmo_pipeline.model.options import load_options
    opts = load_options(tiny_model_files[0])
    encoder = set(row_tile.encoder_gemms(opts))
    real = row_tile.row_rule_breaks

    def breaks(dtype, threads, gemms, loop="onednn", max_rows=132):
        found = real(dtype, threads, gemms, loop, max_rows)
        return found + tuple((k, n, 36) for k, n, *_ in gemms if (k, n, *_) in encoder)
    monkeypatch.setattr(row_tile, "row_rule_breaks", breaks)
    k, n, _, _ = row_tile.encoder_gemms(opts)[0]
    with pytest.raises(ValueError, match=f"GEMM K={k} N={n} gives a row other bits at 36 rows"):
        kernels.check_row_rule("cpu", torch.float32, opts=opts)
