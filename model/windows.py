"""Sentences longer than a window: embedded as overlapping windows, stitched into one vector sequence.

No Beam import; works with any `ElmoEmbedder` through its public `embed_batch`.

A sentence of T tokens with window W and overlap V (W > V >= 0) is cut into windows of W tokens
starting every W - V tokens; the last window is moved back to end at T so that every window is full.
Each window is embedded as a sentence of its own (<S> ... </S> around it, LSTMs from the embedder's
initial state). Position p takes its vectors from the window in which it is farthest from an edge:
where two consecutive windows overlap, the overlap is split at its midpoint (the first half from the
earlier window, the second half from the later one). So every position has at least floor(V/2) tokens of
the sentence on each side inside the window its vectors come from (fewer only near the sentence's own
start and end, as for any sentence). Layer 0 (the context-free token vector) is the same whatever the window.

Memory: windows are embedded in sub-batches of at most `max_tokens` padded token slots
(<S> and </S> included), and the window is capped at `max_tokens - 2` tokens (the overlap then scaled by
the same ratio), so a sentence of any length needs no more memory for the model than one batch (plus its
own output array).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from elmo_pipeline.model.batching import embed_in_batches, plan_batches

DEFAULT_OVERLAP = 200


def default_overlap(window: int) -> int:
    """The overlap when none is given: 200 tokens (100 of context each side of a cut), at most window / 5."""
    return min(DEFAULT_OVERLAP, window // 5)


def effective_window(window: int, max_tokens: int) -> int:
    """The window actually used: `window`, capped so one window (with <S> and </S>) fits `max_tokens`
    (at least 1 token: a budget under 3 slots cannot hold one token, and then a window of 1 exceeds it)."""
    return max(1, min(window, max_tokens - 2))


def effective_overlap(window: int, overlap: int, max_tokens: int) -> int:
    """The overlap actually used: `overlap`, scaled by the same ratio as the window when the budget caps it."""
    w = effective_window(window, max_tokens)
    return overlap if w == window else overlap * w // window


def check_window(window: int, overlap: int, max_tokens: int) -> None:
    """ValueError unless window >= 1, 0 <= overlap < window and max_tokens >= 1 (so windows advance)."""
    if window < 1:
        raise ValueError(f"--window-tokens must be >= 1, got {window}")
    if overlap < 0:
        raise ValueError(f"--window-overlap must be >= 0, got {overlap}")
    if overlap >= window:
        raise ValueError(f"--window-overlap {overlap} must be smaller than --window-tokens {window}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-batch must be >= 1, got {max_tokens}")


def window_spans(n: int, window: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) of each window over n tokens: every `window - overlap` tokens, the last one ending at n.

    One span (0, n) when n <= window."""
    if window < 1 or not 0 <= overlap < window:
        raise ValueError(f"need window >= 1 and 0 <= overlap < window, got window={window} overlap={overlap}")
    if n <= window:
        return [(0, n)]
    stride = window - overlap
    spans = []
    start = 0
    while start + window < n:
        spans.append((start, start + window))
        start += stride
    spans.append((n - window, n))
    return spans


def stitch_plan(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each window, the [start, end) positions of the sentence it supplies (a partition of 0..n).

    Consecutive windows split their overlap at its midpoint."""
    cuts = [spans[0][0]]
    for (_, a_end), (b_start, _) in zip(spans, spans[1:]):
        cuts.append((b_start + a_end + 1) // 2 if b_start < a_end else b_start)
    cuts.append(spans[-1][1])
    return list(zip(cuts, cuts[1:]))


def stitch(pieces: Sequence[np.ndarray], spans: list[tuple[int, int]]) -> np.ndarray:
    """One (L, n, D) array from per-window arrays (L, end - start, D), positions by `stitch_plan`."""
    plan = stitch_plan(spans)
    parts = [piece[:, lo - s: hi - s] for piece, (s, _), (lo, hi) in zip(pieces, spans, plan)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _sub_batches(window: int, overlap: int, max_tokens: int) -> tuple[int, int, int]:
    """(window, overlap) as used under the budget, and how many windows one sub-batch of `max_tokens` holds."""
    check_window(window, overlap, max_tokens)
    w = effective_window(window, max_tokens)
    return w, effective_overlap(window, overlap, max_tokens), max(1, max_tokens // (w + 2))


def window_groups(lengths: Sequence[int], window: int, overlap: int, max_tokens: int) -> list[list[int]]:
    """Indices 0..len(lengths)-1 cut in order into groups of sentences whose windows fill one sub-batch of
    `embed_long_many` (a sentence with more windows than that is a group of its own): a caller that keeps input
    order embeds a group at a time, holding one group's vectors, with as many windows a step as fit."""
    w, v, per_batch = _sub_batches(window, overlap, max_tokens)
    groups: list[list[int]] = []
    filled = 0
    for i, n in enumerate(lengths):
        k = len(window_spans(n, w, v))
        if not groups or filled + k > per_batch:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += k
    return groups


def embed_long(embedder, tokens: Sequence[str], window: int, overlap: int, max_tokens: int) -> np.ndarray:
    """(L, T, D) float32 for one sentence of any length: windows embedded in budget-sized sub-batches.

    A sentence of at most `effective_window(window, max_tokens)` tokens is embedded whole, exactly as
    `embedder.embed_sentence(tokens)`. Not for the `stateful` state mode (windows are not consecutive
    sentences); `stateless` and `warm` start every window from the same state as any sentence."""
    return embed_long_many(embedder, [tokens], window, overlap, max_tokens)[0]


def embed_long_many(embedder, sentences: Sequence[Sequence[str]], window: int, overlap: int,
                    max_tokens: int) -> list[np.ndarray]:
    """embed_long for several sentences at once: the windows of all of them (in order) share the sub-batches,
    so a step of the LSTMs runs as many windows as the budget holds, not only one sentence's few.
    Returns one (L, T_i, D) float32 array per sentence."""
    if getattr(embedder, "state_mode", "stateless") == "stateful":
        raise ValueError("windows need a deterministic state mode (stateless or warm), not stateful")
    w, v, per_batch = _sub_batches(window, overlap, max_tokens)
    sentences = [list(tokens) for tokens in sentences]
    spans = [window_spans(len(tokens), w, v) for tokens in sentences]
    pieces = [tokens[s:e] for tokens, sp in zip(sentences, spans) for s, e in sp]
    out = embed_in_batches(embedder.embed_batch, pieces,
                           plan_batches([len(p) for p in pieces], sort=False, max_sentences=per_batch))
    vectors, at = [], 0
    for sp in spans:
        vectors.append(out[at] if len(sp) == 1 else stitch(out[at: at + len(sp)], sp))
        at += len(sp)
    return vectors


__all__ = ["check_window", "default_overlap", "effective_overlap", "effective_window", "embed_long", "embed_long_many", "stitch", "stitch_plan", "window_groups", "window_spans"]
