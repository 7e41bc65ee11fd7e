"""A batch in the LSTMs' packed layout: index maps between a padded (B, T) batch and the lanes the loops run.

A lane is one row of the LSTM loop: one sentence, or with lanes=True several laid end to end
(model.batching.pack_lanes), each starting from the initial state again (Resets).
"""
from __future__ import annotations

import torch
from torch import Tensor

from elmo_pipeline.model.batching import pack_lanes
from elmo_pipeline.model.device import host_side, upload
from elmo_pipeline.model.row_tile import ROW_TILE, round_up


class Resets:
    """Where lanes of several sentences restart (PackedBatch.resets): before step t, the (layer, row) pairs
    at(t) take their initial state again (a new sentence starts in that lane; direction(g): one direction's rows). `step in resets` says whether any
    do. The oneDNN loop writes those rows in place (at: 4 small kernels); the bmm loop selects whole steps by
    mask(t) (G, width, 1) bool, 2 kernels a step, the masks built on the device for the whole batch on first use
    (2 kernels). dirs, rows, index: device int64 per pair (layer, row, index of its step among the resets);
    spans: step -> (start, end, index) into them; width: rows of the widest step."""

    def __init__(self, dirs: Tensor, rows: Tensor, index: Tensor, spans: dict[int, tuple[int, int, int]],
                 width: int):
        self.dirs, self.rows, self.index, self.spans, self.width = dirs, rows, index, spans, width
        self._masks = None

    def __contains__(self, step: int) -> bool:
        return step in self.spans

    def at(self, step: int) -> tuple[Tensor, ...]:
        a, b, _ = self.spans[step]
        return (self.rows[a:b],) if self.dirs is None else (self.dirs[a:b], self.rows[a:b])

    def direction(self, g: int) -> "Resets":
        """The resets of direction g alone (the oneDNN loop runs each direction by itself): at(t) gives the rows
        only, to index that direction's (n, ...) tensors; no masks. Reads the directions on the host (CPU use)."""
        if not self.spans:
            return self
        mine = self.dirs == g
        before = [0, *mine.cumsum(0).tolist()]                          # pairs of direction g before each pair
        spans = {step: (before[a], before[b], k) for step, (a, b, k) in self.spans.items() if before[b] > before[a]}
        return Resets(None, self.rows[mine], self.index[mine], spans, self.width)

    def mask(self, step: int) -> Tensor:
        if self._masks is None:
            masks = torch.zeros(len(self.spans), 2, self.width, 1, dtype=torch.bool, device=self.dirs.device)
            masks[self.index, self.dirs, self.rows] = True
            self._masks = masks
        return self._masks[self.spans[step][2]]


NO_RESETS = Resets(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                   torch.empty(0, dtype=torch.int64), {}, 0)


class PackedBatch:
    """Index maps between a padded (B, T) batch and the packed layouts of both directions, built on the host
    from the host-side lengths and sent to the device in one copy (model/device.py: upload).

    The LSTMs run over lanes: one sentence each, or with lanes=True several laid end to end
    (model.batching.pack_lanes, capacity T), each starting from the initial state again (`resets`), so that
    nearly every lane runs at every step. The packed layout is time-major over the lanes, longest first.
    Packed element k of the forward direction is flat position fwd_index[k] (= row * T + t);
    of the backward direction, bwd_index[k] (each lane reversed, so each of its sentences is reversed within
    its own length); bwd_from_fwd[k] is the forward packed element holding the same token as backward element k.
    `order` is, per lane in packed order, the batch row whose initial state the lane takes (its first
    sentence); `inv_order` its inverse while every lane holds one sentence (n_lanes == B), else None.
    resets (Resets): the (direction, row) pairs (0 forward, 1 backward; rows of the step) where a new sentence
    starts at a step: those rows take their initial state again. Empty when lanes hold one sentence.
    tokens=True: fwd_rows / bwd_rows (the tokens layout, see _token_rows) instead of fwd_index / bwd_index.
    batch_invariant=True: step_rows (rows per step, multiples of ROW_TILE) and `at` (padded position of each
    packed element). extra(fwd_index_host) -> more host int64 tensors to send in the same copy.
    Host attributes: lengths, batch_sizes, n_lanes, rows / steps and bwd_rows_host / bwd_steps (each
    packed element's sentence and position in it, per direction), step_rows; everything else is on `device`.
    """

    def __init__(self, lengths: Tensor, max_len: int, device: torch.device, *, tokens: bool = False,
                 batch_invariant: bool = False, extra=None, lanes: bool = False):
        with host_side():
            lengths = torch.as_tensor(lengths).to("cpu", torch.int64)   # host data (a device tensor here syncs)
            self.lengths = lengths
            B, T = len(lengths), max_len
            if lanes and B > 1:
                lane_of, start = (torch.tensor(v, dtype=torch.int64) for v in pack_lanes(lengths.tolist(), T))
            else:
                lane_of, start = torch.arange(B), torch.zeros(B, dtype=torch.int64)
            L = int(lane_of.max()) + 1 if B else 0
            self.n_lanes = L
            lane_len = torch.zeros(L, dtype=torch.int64).index_add_(0, lane_of, lengths)
            first = torch.zeros(L, dtype=torch.int64)                   # each lane's first sentence
            first[lane_of[start == 0]] = torch.arange(B)[start == 0]
            sorted_len, lane_order = torch.sort(lane_len, descending=True, stable=True)
            steps = torch.arange(T)
            active = steps[:, None] < sorted_len[None, :]                   # (T, L)
            self.batch_sizes = active.sum(dim=1).tolist()
            while self.batch_sizes and self.batch_sizes[-1] == 0:
                self.batch_sizes.pop()
            lane = lane_order[None, :].expand(T, -1)[active]                # per packed element, time-major
            t = steps[:, None].expand(-1, L)[active]
            # which sentence, and which of its positions, sits at each slot of each lane
            sent = torch.repeat_interleave(torch.arange(B), lengths)
            pos = torch.arange(len(sent)) - (torch.cumsum(lengths, 0) - lengths)[sent]
            sent_at = torch.zeros(L, T, dtype=torch.int64)
            pos_at = torch.zeros(L, T, dtype=torch.int64)
            sent_at[lane_of[sent], start[sent] + pos] = sent
            pos_at[lane_of[sent], start[sent] + pos] = pos
            back = lane_len[lane] - 1 - t                                   # the backward direction's slot
            self.rows, self.steps = sent_at[lane, t], pos_at[lane, t]
            self.bwd_rows_host, self.bwd_steps = sent_at[lane, back], pos_at[lane, back]
            fwd = self.rows * T + self.steps
            bwd = self.bwd_rows_host * T + self.bwd_steps
            packed_at = torch.empty(B * T, dtype=torch.int64)
            packed_at[fwd] = torch.arange(len(fwd))
            order = first[lane_order]
            host = {"order": order, "bwd_from_fwd": packed_at[bwd]}
            if L == B:
                inv = torch.empty_like(order)
                inv[order] = torch.arange(B)
                host["inv_order"] = inv
            else:
                self.inv_order = None
            if tokens:
                host["fwd_rows"], host["bwd_rows"], self.n_tokens = self._token_rows()
            else:
                host["fwd_index"], host["bwd_index"] = fwd, bwd
            self.step_rows = None
            firsts = torch.tensor([0, *self.batch_sizes[:-1]], dtype=torch.int64).cumsum(0)
            if batch_invariant and self.batch_sizes:
                self.step_rows = [round_up(n, ROW_TILE) for n in self.batch_sizes]
                # padded position of each packed element: step t's rows start at sum(step_rows[:t])
                starts = torch.tensor([0, *self.step_rows[:-1]], dtype=torch.int64).cumsum(0)
                host["at"] = starts[t] + torch.arange(len(t)) - firsts[t]
            resets = self._resets(t, firsts, lengths)
            if resets is not None:
                host["reset_dirs"], host["reset_rows"], host["reset_index"], spans = resets
            if extra is not None:
                host.update(extra(fwd))
        self.host = host
        for name, tensor in upload(host, device).items():
            setattr(self, name, tensor)
        self.resets = NO_RESETS if resets is None else \
            Resets(self.reset_dirs, self.reset_rows, self.reset_index, spans, self.step_rows[0] if self.step_rows else L)

    def _resets(self, t: Tensor, firsts: Tensor, lengths: Tensor):
        """Where a sentence other than a lane's first starts: None when nowhere, else (direction, row of its
        step, index of its step among these steps) of each such element, sorted by step, and
        {step: (start, end, index)} into them."""
        fwd = (self.steps == 0) & (t > 0)
        bwd = (self.bwd_steps == lengths[self.bwd_rows_host] - 1) & (t > 0)
        if not bool(fwd.any()) and not bool(bwd.any()):
            return None
        row = torch.arange(len(t)) - firsts[t]                        # row of each element within its step
        step = torch.cat([t[fwd], t[bwd]])
        order = torch.argsort(step, stable=True)
        dirs = torch.cat([torch.zeros(int(fwd.sum()), dtype=torch.int64), torch.ones(int(bwd.sum()), dtype=torch.int64)])
        steps, index, counts = torch.unique_consecutive(step[order], return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).tolist()
        spans = {s: (e - n, e, k) for k, (s, n, e) in enumerate(zip(steps.tolist(), counts.tolist(), ends))}
        return dirs[order], torch.cat([row[fwd], row[bwd]])[order], index, spans

    def _token_rows(self) -> tuple[Tensor, Tensor, int]:
        """Rows of the tokens layout for each packed element of both directions: the real tokens (neither
        <S> nor </S>) of row b at offsets[b] + position - 1, sentence after sentence; the boundary tokens
        at n + 2b and n + 2b + 1, past the n real tokens. Returns (fwd_rows, bwd_rows, n) on the host."""
        real = self.lengths - 2
        starts = torch.cumsum(real, 0) - real
        n = int(real.sum())

        def rows_of(r: Tensor, pos: Tensor) -> Tensor:
            inside = (pos >= 1) & (pos <= self.lengths[r] - 2)
            return torch.where(inside, starts[r] + pos - 1, n + 2 * r + (pos > 0).long())

        return rows_of(self.rows, self.steps), rows_of(self.bwd_rows_host, self.bwd_steps), n
