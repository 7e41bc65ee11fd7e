"""Length-sorted batches under a token budget (the embedder, the pipeline and the benchmarks use it).

A batch's cost is its padded size: n_sentences * (longest + 2) token slots (<S> and </S> included).
"""
from __future__ import annotations


def plan_batches(lengths: list[int], max_tokens: int, sort: bool = True) -> list[list[int]]:
    """Indices grouped into batches whose padded size n * (max_len + 2) stays <= max_tokens.

    sort=True orders by length first (less padding); sort=False keeps input order (stateful mode).
    A sentence longer than the budget is a batch of its own."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if sort else range(len(lengths))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i] + 2)
        if cur and new_max * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, new_max = [], lengths[i] + 2
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def padding(lengths: list[int]) -> tuple[int, int]:
    """(real tokens, padded token slots) of one batch of sentence lengths, without <S>/</S>."""
    return sum(lengths), len(lengths) * max(lengths, default=0)
