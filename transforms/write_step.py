"""The writing step's Beam shells: WriteShards (staged shards, output.staging) and SkipCommitted (the
sentences a resumed run already committed, output.state)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import apache_beam as beam
from apache_beam.metrics import Metrics

from elmo_pipeline.transforms.chain import NS, in_global_window
from elmo_pipeline.transforms.logs import worker_logs
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.records import EmbeddedBatch, Item
from elmo_pipeline.output.staging import ShardSpec, Staging
from elmo_pipeline.output.state import load_done_ids
from elmo_pipeline.output.stats import RunStats


class WriteShards(beam.DoFn):
    """EmbeddedBatch -> staged shard files -> ShardInfo. A shard ends at `shard_sentences` sentences, at
    `shard_bytes` of buffered vectors as stored (so memory is bounded whatever the model's width), or at
    the bundle's end; a batch may be split between two shards.

    A full shard is written by threads of this DoFn's own while the Beam thread goes on embedding: at most
    WRITERS shards are being written and one is filling (memory: (WRITERS + 1) x --shard-bytes). Two writers
    keep both cores of a 2-core worker busy when a shard's writing takes about as long as its embedding
    (benchmarks/host_cost.py). The writers do mostly C work that releases the GIL: Parquet encoding,
    HDF5, file and object-store I/O. The biLM runs on the Beam thread or on EmbedBatches' threads."""

    WRITERS = 2

    def __init__(self, staging: Staging, spec: ShardSpec, shard_sentences: int, shard_bytes=64 << 20):
        self.staging, self.spec = staging, spec
        self.shard_sentences, self.shard_bytes = shard_sentences, shard_bytes
        self.shards = Metrics.counter(NS, "shards")
        self.run_stats = RunStats()

    def setup(self):
        self.pool = ThreadPoolExecutor(self.WRITERS, thread_name_prefix="elmo-write")
        self.per_token = self.spec.bytes_per_token

    def teardown(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    def start_bundle(self):
        self.buf, self.nbytes, self.writing = [], 0, []

    def _written(self, keep: int = 0):
        """The ShardInfos of the oldest shards being written, once they are (their errors raise here), until
        at most `keep` are left writing."""
        while len(self.writing) > keep:
            info, seconds = self.writing.pop(0).result()
            self.run_stats.time("write", seconds)
            yield info

    def _flush(self):
        sentences, self.buf, self.nbytes = self.buf, [], 0
        if sentences:
            yield from self._written(keep=self.WRITERS - 1)
            self.shards.inc()
            self.writing.append(self.pool.submit(_timed, self.staging.shard, sentences, self.spec))

    def process(self, batch: EmbeddedBatch):
        for b in range(len(batch.items)):
            self.buf.append((batch, b))
            self.nbytes += batch.tokens(b) * self.per_token
            if len(self.buf) >= self.shard_sentences or self.nbytes >= self.shard_bytes:
                yield from self._flush()

    def finish_bundle(self):
        for info in [*self._flush(), *self._written()]:
            yield in_global_window(info)


def _timed(fn, *args):
    """(fn(*args), its wall seconds): on a writer thread, so the stats are added on the Beam thread."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


class SkipCommitted(beam.DoFn):
    """Drops (and counts) the sentences an interrupted run with the same run key already committed.

    The ids come from the commit records prepare_output() kept (output/state.py), loaded once."""

    def __init__(self, record_paths: list[str], storage_options, progress: ProgressSpec | None = None):
        self.record_paths, self.so, self.progress = record_paths, storage_options, progress
        self.skipped = Metrics.counter(NS, "sentences_resumed")

    def setup(self):
        worker_logs()
        self.done = load_done_ids(self.record_paths, self.so)

    def process(self, item: Item):
        if item.id in self.done:
            self.skipped.inc()
            advance(self.progress, item.nbytes)      # committed by the interrupted run: done
        else:
            yield item
