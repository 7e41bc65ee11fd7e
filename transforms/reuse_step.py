"""--reuse's Beam shell: CopyReused (transforms/reuse.py) reads the found sentences' vectors from their source shard."""
from __future__ import annotations

import apache_beam as beam
from apache_beam.metrics import Metrics

from elmo_pipeline.transforms.chain import NS
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.reuse import ReuseSource, read_vectors, reused_batches


class CopyReused(beam.DoFn):
    """(source shard, [(row, Item)]) -> EmbeddedBatches of those Items with the source's stored vectors of those
    rows, `batch` sentences at most each; the shard's rows are read once. Their copies (--dedupe) ride along."""

    def __init__(self, sources: list[ReuseSource], shard_spec, storage_options, progress: ProgressSpec | None = None,
                 batch: int = 2000):
        self.sources, self.spec, self.so = sources, shard_spec, storage_options
        self.progress, self.batch = progress, batch
        self.reused = Metrics.counter(NS, "sentences_reused")

    def process(self, element):
        (source, shard), found = element
        found = sorted(found, key=lambda f: (f[0], f[1].id))
        src, spec = self.sources[source], self.spec
        tokens, stored, lengths = read_vectors(src, shard, [r for r, _ in found], list(spec.columns), self.so)
        for out in reused_batches(found, tokens, stored, lengths, spec, src.label, self.batch):
            self.reused.inc(len(out.items))
            advance(self.progress, sum(i.nbytes for i in out.items))
            yield out
