"""batch_invariant's row tile: every GEMM of the invariant path gets a multiple of ROW_TILE rows.

Measured on torch 2.13's CPU GEMMs (AMD EPYC, AVX-512, 1 and 2 threads): a row's bits are the same for every
multiple of 4 rows, at any row position; 1-3 rows take another kernel, and at 2 threads 5-7 and 9-11 rows can
differ too. So the token encoder pads its inputs and the LSTMs pad each step to round_up(n, ROW_TILE) rows
(docs/exactness.md).
"""
from __future__ import annotations

import functools

import torch

ROW_TILE = 4


def round_up(n: int, tile: int = ROW_TILE) -> int:
    """The smallest multiple of tile that is >= n."""
    return -(-n // tile) * tile


def first_rows_keep_their_bits(gemm, x, tile: int = ROW_TILE) -> list[int]:
    """The row counts m (multiples of tile, tile <= m <= len(x)) at which gemm(x[:m])[:tile] differs bitwise from
    gemm(x[:tile]); [] when the row rule holds for this GEMM. gemm: (m, K) tensor -> (m, N) tensor, pure."""
    ref = gemm(x[:tile])
    return [m for m in range(tile, x.shape[0] + 1, tile) if not bool((gemm(x[:m])[:tile] == ref).all())]


def step_gemms(opts, loop: str) -> tuple:
    """The step GEMMs (K, N, post-op, scalars) of a biLM's LSTM layers (opts: model.options.BiLMOptions) as `loop`
    runs them: onednn, [x, h] (2P) -> the sigmoid gates (3H) and gate j (H), the projection H -> P with its clip;
    bmm, x -> 4H, h -> 4H and H -> P, the directions side by side."""
    P, H, clip = opts.projection_dim, opts.lstm_dim, opts.proj_clip
    if loop == "onednn":
        return ((2 * P, 3 * H, "sigmoid", ()), (2 * P, H, "tanh", ()),
                (H, P, "hardtanh", (-clip, clip)) if clip else (H, P, "none", ()))
    return ((P, 4 * H, "", ()), (P, 4 * H, "", ()), (H, P, "", ()))


def encoder_gemms(opts) -> tuple:
    """The token encoder's GEMMs (K, N, post-op, scalars) on a batch-invariant path's padded tokens: per filter width
    w the unfolded character windows (w * E) -> its n filters, the highways F -> 2F, the projection F -> P (when
    F != P); () for a word encoder (a table lookup)."""
    if opts.char_cnn is None:
        return ()
    E, F = int(opts.char_cnn["embedding"]["dim"]), opts.n_filters
    convs = tuple(dict.fromkeys((w * E, n, "none", ()) for w, n in opts.filters))
    highway = ((F, 2 * F, "none", ()),) if opts.char_cnn.get("n_highway") else ()
    return convs + highway + (((F, opts.projection_dim, "none", ()),) if F != opts.projection_dim else ())


@functools.lru_cache(maxsize=None)
def row_rule_breaks(dtype: torch.dtype, threads: int, gemms: tuple, loop: str = "onednn",
                    max_rows: int = 132) -> tuple:
    """The (K, N, rows) at which this process's GEMMs (`gemms`: step_gemms() or encoder_gemms(); `loop`: onednn's
    linear with its post-op, bmm over both directions, or torch's linear) give the first ROW_TILE rows other bits
    than at ROW_TILE rows, at `threads` torch threads, for every multiple of ROW_TILE up to max_rows; () when the
    rule holds, or for onednn when this torch has no oneDNN for dtype. Computed once per process per key (random weights, fixed seed)."""
    if loop == "onednn" and (not torch.backends.mkldnn.is_available() or (
            dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        return ()
    g, before = torch.Generator().manual_seed(0), torch.get_num_threads()
    breaks = []
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for k, n, attr, scalars in gemms:
                bad = first_rows_keep_their_bits(_gemm(loop, k, n, attr, list(scalars), dtype, g),
                                                 torch.randn(max_rows, k, generator=g).to(dtype))
                breaks += [(k, n, m) for m in bad]
    finally:
        torch.set_num_threads(before)
    return tuple(breaks)


def _gemm(loop: str, k: int, n: int, attr: str, scalars: list, dtype: torch.dtype, g: torch.Generator):
    """A (m, K) -> (m, N) GEMM as `loop` calls it, on random weights."""
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    if loop == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, b, attr, scalars, "")
    if loop == "torch":
        return lambda rows: torch.nn.functional.linear(rows, w, b)
    both = torch.stack([w.t(), w.t().flip(0)])                       # (2, K, N): the two directions' weights
    return lambda rows: torch.bmm(rows.expand(2, *rows.shape).contiguous(), both)[0]


def row_rule_error(breaks: tuple, dtype: torch.dtype, loop: str = "onednn") -> str | None:
    """The one-line refusal for --batch-invariant when row_rule_breaks found breaks (in `loop`'s GEMMs); None when
    it found none."""
    if not breaks:
        return None
    k, n, m = breaks[0]
    library = {"onednn": "oneDNN", "bmm": "batched (bmm)", "torch": "torch"}.get(loop, loop)
    return (f"--batch-invariant cannot keep a row's bits in {str(dtype).removeprefix('torch.')} on this CPU: its "
            f"{library} GEMM K={k} N={n} gives a row other bits at {m} rows than at {ROW_TILE} rows "
            f"({len(breaks)} row counts); run without it, or with --compute-dtype float32")


def row_rule() -> dict:
    """The batch-invariant path's row rule as a JSON-able record (for the manifest's kernel path)."""
    return {"row_tile": ROW_TILE}
