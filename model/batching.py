"""Length-sorted batches under a token budget: the one batching rule of the pipeline (SortAndBatch), the
embedder (ElmoEmbedder.embed_sentences), RunInference (transforms.inference), long sentences' windows
(model.windows) and the dry run. plan_batches decides which sentences go in which batch; embed_in_batches
runs a plan through an embedder's embed_batch and puts the results back in input order.

A batch's cost is its padded size: n_sentences * (longest + 2) token slots (<S> and </S> included); where
the model lays sentences end to end in lanes (pack_lanes; stateless and warm modes), its token slots.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence


def plan_batches(lengths: list[int], max_tokens: int = 0, sort: bool = True, lanes: bool = False, *,
                 max_sentences: int = 0) -> list[list[int]]:
    """Indices grouped into batches whose padded size n * (max_len + 2) stays <= max_tokens.

    sort=True orders by length first (less padding); sort=False keeps input order (stateful mode).
    lanes=True (the model lays a batch's sentences end to end in lanes, pack_lanes): a batch's size is its
    token slots, sum(len + 2), as there is next to no padding left to pay for; and the slots are shared out
    evenly between the fewest batches the budget allows, so no batch is a small remainder (a remainder of the
    longest sentences would run their many steps on few lanes). Either way the concatenated batches are the
    same length-sorted order.
    A sentence longer than the budget is a batch of its own.
    max_sentences > 0: batches of that many sentences of the same order instead (the last one the rest;
    max_tokens and lanes unused)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if sort else list(range(len(lengths)))
    if max_sentences > 0:
        return [order[start:start + max_sentences] for start in range(0, len(order), max_sentences)]
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if lanes:
        return _even_batches([lengths[i] + 2 for i in order], order, max_tokens)
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


def embed_in_batches(embed_batch: Callable[[list], list], sentences: Sequence, batches: list[list[int]]) -> list:
    """embed_batch run on each planned batch of `sentences` in plan order (plan_batches); its results (one
    per sentence) in input order."""
    out: list = [None] * len(sentences)
    for idx in batches:
        for i, result in zip(idx, embed_batch([sentences[i] for i in idx])):
            out[i] = result
    return out


def _even_batches(slots: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """order cut into consecutive batches of <= max_tokens slots each (a sentence over it alone), each closed
    once it holds its share of the slots left: left / ceil(left / max_tokens)."""
    left = sum(slots)
    share = left / max(1, -(-left // max_tokens))
    batches: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, s in zip(order, slots):
        if cur and (size + s > max_tokens or size >= share):
            batches.append(cur)
            left -= size
            share = left / max(1, -(-left // max_tokens))
            cur, size = [], 0
        cur.append(i)
        size += s
    if cur:
        batches.append(cur)
    return batches


def padding(lengths: list[int], lanes: bool = False) -> tuple[int, int]:
    """(real tokens, padded token slots) of one batch of sentence lengths, without <S>/</S>.
    lanes=True: the slots of the lanes pack_lanes lays them in (each lane as long as the longest sentence)."""
    if not lanes or len(lengths) < 2:
        return sum(lengths), len(lengths) * max(lengths, default=0)
    longest = max(lengths) + 2
    n_lanes = max(pack_lanes([n + 2 for n in lengths], longest)[0]) + 1
    return sum(lengths), n_lanes * longest - 2 * len(lengths)


def pack_lanes(lengths: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """Sentences laid end to end in lanes of at most `capacity` token slots, so that the LSTM loop runs
    every lane at every step instead of a tail of steps where only the longest sentences remain.

    Worst-fit decreasing: longest first, each into the lane with the most room, a new lane when none has
    room (a sentence longer than capacity opens its own). A lane stays within capacity, so the loop's steps
    stay those of the longest sentence, and every lane but the last few opened is full to a short sentence.
    Returns (lane, start) per sentence: its lane and its first slot in that lane."""
    lane, start = [0] * len(lengths), [0] * len(lengths)
    used: list[int] = []
    heap: list[tuple[int, int]] = []          # (-room, lane)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if heap and -heap[0][0] >= n:
            k = heapq.heappop(heap)[1]
        else:
            k = len(used)
            used.append(0)
        lane[i], start[i] = k, used[k]
        used[k] += n
        heapq.heappush(heap, (used[k] - capacity, k))
    return lane, start
