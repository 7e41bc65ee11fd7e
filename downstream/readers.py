"""Reading the pipeline's output back as torch datasets: sentences with their layers, ids, tokens and labels.
No Beam import.

An output folder is opened through its manifest.json, so only complete, committed shards are read
(never files of retried bundles under _staging/). Local paths and fsspec URLs (s3://, gs://, ...) work;
`storage_options` are the fsspec options of the folder's filesystem (e.g. {"endpoint_url": ...} for s3).

    from elmo_pipeline.downstream import ElmoOutput, ElmoDataset, ElmoIterableDataset, collate, to_arrow_table

    out = ElmoOutput("out/corpus")                    # manifest, shards, layer names, widths
    for s in out.sentences():                         # dicts: id, doc_id, sentence_index, tokens, layers
        s["layers"]                                   # float32 (L, T, 2P), layer 0 duplicated: = ElmoEmbedder output
    ds = ElmoDataset("out/corpus", labels={"doc-1": 1})                 # map-style (torch Dataset)
    it = ElmoIterableDataset("out/corpus", shuffle=True, seed=0)        # streams, shuffles across shards
    loader = DataLoader(it, batch_size=32, collate_fn=collate, num_workers=2)
    table = to_arrow_table("out/corpus", columns=["id", "tokens", "layer_2"])   # pyarrow.Table

A record's `layers` always stacks the selected layers as (L, T, 2P) float32: layer 0, which the Parquet
output stores P wide by default (the token vector once), is duplicated to [x, x] as AllenNLP does, so a
record equals what `model.ElmoEmbedder.embed_sentence` returns for the same tokens (layer selection
`--layers all`). Outputs written with `--layers average` or `top` give L = 1.
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from elmo_pipeline.downstream.batching import Batcher
from elmo_pipeline.downstream.output import ElmoOutput, open_outputs
from elmo_pipeline.downstream.record_labels import attach_label


try:  # torch is a dependency of the package; keep the module importable for pure-arrow use anyway
    from torch.utils.data import Dataset as _TorchDataset
    from torch.utils.data import IterableDataset as _TorchIterable
except ImportError:  # pragma: no cover
    _TorchDataset = _TorchIterable = object  # type: ignore[assignment,misc]


class ElmoDataset(_TorchDataset):
    """Map-style dataset over one or more output folders, held in memory as stored (float16 stays float16,
    layer 0 P wide); record i is built on access. Records are in manifest order (shard by shard).

    labels: {sentence id | document id | line number: label}; records without a label are dropped
    (their count is `unlabelled`). label_key: the record key the label goes to ("label", or "tags"
    for token labels). transform: applied to each record on access.
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", fmt: str | None = None,
                 layers: Sequence[str] | None = None, labels: Mapping[str, Any] | None = None,
                 label_key: str = "label", storage_options: Mapping[str, Any] | None = None, transform=None):
        self.outputs = open_outputs(sources, storage_options)
        self.records: list[dict] = []
        self._source: list[int] = []
        self.unlabelled = 0
        self.transform = transform
        for k, out in enumerate(self.outputs):
            for i in range(len(out.shards)):
                for r in out.iter_shard(i, fmt, layers, stacked=False):
                    r = attach_label(r, labels, label_key)
                    if r is None:
                        self.unlabelled += 1
                        continue
                    self.records.append(r)
                    self._source.append(k)
        self.dim = self.outputs[0].dim if self.outputs else 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        r = dict(self.records[i])
        r["layers"] = self.outputs[self._source[i]].stack(r.pop("stored"))
        return self.transform(r) if self.transform else r


class ElmoIterableDataset(_TorchIterable):
    """Streams records of one or more output folders without loading them all.

    shuffle: shard order is permuted (seed + epoch) and records pass through a shuffle buffer of
    `buffer_size` (seeded by seed, epoch and worker). Under a DataLoader with workers, each worker reads
    a disjoint share of the shards (worker w takes shards w, w + n, ...), so every record comes once
    per epoch; with fewer shards than workers some workers get none. Call set_epoch(e) before each
    epoch for a new order (without it every iteration repeats the same order).
    """

    def __init__(self, sources: "str | ElmoOutput | Sequence[str | ElmoOutput]", fmt: str | None = None,
                 layers: Sequence[str] | None = None, labels: Mapping[str, Any] | None = None,
                 label_key: str = "label", shuffle: bool = True, seed: int = 0, buffer_size: int = 1000,
                 storage_options: Mapping[str, Any] | None = None, transform=None):
        self.outputs = open_outputs(sources, storage_options)
        self.fmt, self.layers, self.labels, self.label_key = fmt, layers, labels, label_key
        self.shuffle, self.seed, self.buffer_size = shuffle, seed, max(1, buffer_size)
        self.transform = transform
        self.epoch = 0
        self.units = [(o, i) for o in self.outputs for i in range(len(o.shards))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_sentences(self) -> int:
        """Sentences listed in the manifests (labelled or not; no __len__, as labels may drop some)."""
        return sum(o.num_sentences for o in self.outputs)

    def __iter__(self) -> Iterator[dict]:
        import torch.utils.data
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        units = list(self.units)
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}:shards").shuffle(units)
        units = units[worker::n_workers]
        records = self._records(units)
        if self.shuffle:
            records = buffer_shuffle(records, self.buffer_size, random.Random(f"{self.seed}:{self.epoch}:{worker}"))
        for r in records:
            yield self.transform(r) if self.transform else r

    def _records(self, units) -> Iterator[dict]:
        for out, i in units:
            for r in out.iter_shard(i, self.fmt, self.layers):
                r = attach_label(r, self.labels, self.label_key)
                if r is not None:
                    yield r


def buffer_shuffle(items: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    """Approximate shuffle in bounded memory: keep `size` items, emit a random one as each new arrives."""
    buf: list[dict] = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        j = rng.randrange(size)
        buf[j], x = x, buf[j]
        yield x
    rng.shuffle(buf)
    yield from buf


def collate(records: Sequence[dict]) -> dict:
    """Pad a list of records into a batch (batching.Batcher.records): layers (B, L, T, D) float32, zero past
    each length; mask (B, T) bool; lengths (B,) int64; ids, doc_ids, tokens (lists); label (B,) int64 when
    the records have int labels, tags (B, T) int64 padded with -100 when int lists (other labels stay lists)."""
    D = int(records[0]["layers"].shape[2]) if records else 0
    return Batcher(D).records(records)
