"""Length-bucketed batches of dataset positions: deterministic per (seed, epoch), split across ranks, resumable.
No Beam import.

    from elmo_pipeline.downstream.sampler import BucketBatchSampler

    sampler = BucketBatchSampler(ds.lengths, batch_size=32, shuffle=True, seed=0, rank=r, world_size=w)
    sampler.set_epoch(e, start_batch=k)             # the order of epoch e, resumed after k batches
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

try:
    from torch.utils.data import Sampler as _TorchSampler
except ImportError:  # pragma: no cover
    _TorchSampler = object  # type: ignore[assignment,misc]


class BucketBatchSampler(_TorchSampler):
    """Batches of dataset positions, deterministic per (seed, epoch), split across ranks, resumable.

    lengths: tokens per sentence (MappedDataset.lengths). Positions (in order, or with shuffle=True a
    permutation of (seed, epoch)) are cut into buckets of `bucket_batches` batches, each bucket sorted by
    length before it is cut into batches (little padding); with shuffle the batches are then permuted.
    bucket_batches=0: no sorting, batches of consecutive positions.
    max_tokens: cap a batch at this many padded tokens (B x longest) instead of a fixed count.
    Ranks (DistributedSampler's splitting): rank r takes batches r, r + world_size, ...; the list is
    wrapped so every rank gets the same count. set_epoch(e, start_batch=k): epoch e's order, resumed after
    the first k batches of this rank. Under DataLoader workers each batch is fetched once (the loader
    deals the batches out).
    """

    def __init__(self, lengths: np.ndarray, batch_size: int = 32, shuffle: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1, bucket_batches: int = 100, max_tokens: int | None = None,
                 drop_last: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.shuffle, self.seed = max(1, batch_size), shuffle, seed
        self.rank, self.world_size, self.bucket_batches = rank, world_size, max(0, bucket_batches)
        self.max_tokens, self.drop_last = max_tokens, drop_last
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def _cut(self, order: np.ndarray) -> list[np.ndarray]:
        if self.max_tokens is None:
            return [order[s: s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        out, start, longest = [], 0, 0
        for j, p in enumerate(order):
            longest = max(longest, int(self.lengths[p]))
            if j > start and (longest * (j - start + 1) > self.max_tokens or j - start >= self.batch_size):
                out.append(order[start:j])
                start, longest = j, int(self.lengths[p])
        if start < len(order):
            out.append(order[start:])
        return out

    def all_batches(self) -> list[np.ndarray]:
        """Every batch of this epoch, all ranks, in order."""
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if not self.bucket_batches:
            batches = self._cut(order)
        else:
            size, batches = self.batch_size * self.bucket_batches, []
            for s in range(0, n, size):
                chunk = order[s: s + size]
                batches += self._cut(chunk[np.argsort(self.lengths[chunk], kind="stable")])
        return [batches[j] for j in rng.permutation(len(batches))] if self.shuffle else batches

    def rank_batches(self) -> list[np.ndarray]:
        """This rank's batches of this epoch (before start_batch is applied)."""
        batches = self.all_batches()
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.world_size]
        elif batches and len(batches) % self.world_size:
            pad = self.world_size - len(batches) % self.world_size
            batches = batches + [batches[j % len(batches)] for j in range(pad)]
        return batches[self.rank:: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        for b in self.rank_batches()[self.start_batch:]:
            yield b.tolist()

    def __len__(self) -> int:
        return max(0, len(self.rank_batches()) - self.start_batch)
