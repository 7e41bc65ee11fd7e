"""batch_invariant's row tile: every GEMM of the invariant path gets a multiple of ROW_TILE rows.

Measured on torch 2.13's CPU GEMMs (AMD EPYC, AVX-512, 1 and 2 threads): a row's bits are the same for every
multiple of 4 rows, at any row position; 1-3 rows take another kernel, and at 2 threads 5-7 and 9-11 rows can
differ too. So the token encoder pads its inputs and the LSTMs pad each step to round_up(n, ROW_TILE) rows
(docs/exactness.md).
"""
from __future__ import annotations

ROW_TILE = 4


def round_up(n: int, tile: int = ROW_TILE) -> int:
    """The smallest multiple of tile that is >= n."""
    return -(-n // tile) * tile
