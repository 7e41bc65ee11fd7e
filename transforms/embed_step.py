"""The embedding step's Beam shells: SortAndBatch (model.batching) and EmbedBatches (transforms.embed_items)."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.utils import shared

from elmo_pipeline.model.batching import padding, plan_batches
from elmo_pipeline.transforms.chain import DEAD, NS, in_global_window
from elmo_pipeline.transforms.dedupe import occurrences, with_copies
from elmo_pipeline.model.resolve import ModelSpec
from elmo_pipeline.transforms.embed import shared_model
from elmo_pipeline.transforms.embed_items import embed_alone, embed_windowed, embedding_failed, split_at_window, window_limit
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.records import EmbeddedBatch, Item
from elmo_pipeline.output.stats import RunStats
from elmo_pipeline.transforms import worker_exit


class SortAndBatch(beam.DoFn):
    """Items -> lists of Items: a bounded buffer cut by a token budget. sort (model.options.sentences_independent):
    sorted by length and budgeted in lane token slots; False (stateful) keeps input order and counts padded slots."""

    def __init__(self, max_tokens: int, buffer_size: int, sort: bool = True):
        self.max_tokens, self.buffer_size, self.sort = max_tokens, buffer_size, sort
        self.batches = Metrics.counter(NS, "batches")
        self.real = Metrics.counter(NS, "batch_tokens")
        self.slots = Metrics.counter(NS, "batch_token_slots")
        self.run_stats = RunStats()

    def start_bundle(self):
        self.buf = []

    def _flush(self):
        items, self.buf = self.buf, []
        t0 = time.perf_counter()
        lengths = [len(i.tokens) for i in items]
        batches = plan_batches(lengths, self.max_tokens, self.sort, lanes=self.sort)
        self.run_stats.time("batch", time.perf_counter() - t0)
        for idx in batches:
            real, slots = padding([lengths[i] for i in idx], lanes=self.sort)
            self.run_stats.batch(slots // len(idx) if idx else 0, real, slots)
            self.batches.inc()
            self.real.inc(real)
            self.slots.inc(slots)
            yield [items[i] for i in idx]

    def process(self, item: Item):
        self.buf.append(item)
        if len(self.buf) >= self.buffer_size:
            yield from self._flush()

    def finish_bundle(self):
        for batch in self._flush():
            yield in_global_window(batch)


class _Job:
    """One batch in EmbedBatches: its items, the part embedded as one batch (`short`, its result or error once known),
    the sentences over the window (`long`, embedded in windows together) and those embedded one by one
    (`single`: a failed part's), with the batch's start times."""

    def __init__(self, batch: list[Item], short: list[Item], long: list[Item]):
        self.batch, self.short, self.long, self.single = batch, short, long, []
        self.t0, self.start = time.perf_counter(), time.time()
        self.future: Future | None = None


class EmbedBatches(beam.DoFn):
    """list[Item] -> EmbeddedBatch (the batch's vectors, packed); the model is loaded once per process (Shared:
    shared_model; `models`, the handle a launcher that runs the workers in its process already holds the model
    by) for all threads.

    A failing batch is retried sentence by sentence; sentences that still fail go to DEAD.
    window > 0: a sentence longer than the (budget-capped) window is embedded as overlapping windows in
    sub-batches of at most `max_tokens` slots, stitched back together (model/windows.py); the windows of all such
    sentences of a batch share the sub-batches.
    `progress`: the bar advances by the batch's input bytes (transforms/progress.py).
    layers: only these layers (ascending) are copied out of the model (ShardSpec.layers_read; None: all).
    threads > 1 (stateless and warm state): up to `threads` batches run through the biLM at once, each on a
    thread of this DoFn's own with the Beam thread's torch thread count; the Beam thread prepares each batch's
    token vectors in arrival order (ElmoEmbedder.prepare_packed) and emits the batches in that order, so the
    vectors and their order are those of threads=1. The biLM's GEMMs release the GIL: two batches on a
    1-torch-thread worker use two cores (benchmarks/host_cost.py). Each batch names the kernel path that embedded
    it (EmbeddedBatch.kernel), which the shard's commit record keeps."""

    def __init__(self, spec: ModelSpec, progress: ProgressSpec | None = None, window: int = 0, overlap: int = 0,
                 max_tokens: int = 0, layers: tuple[int, ...] | None = None, threads: int = 1,
                 models: shared.Shared | None = None):
        self.spec, self.progress, self.layers = spec, progress, layers
        self.window, self.overlap, self.max_tokens = window, overlap, max_tokens
        self.threads = max(1, threads)
        self.windowed = Metrics.counter(NS, "windowed_sentences")
        self._shared = models or shared.Shared()
        self.seconds = Metrics.counter(NS, "embed_milliseconds")
        self.dead = Metrics.counter(NS, "dead_letters")
        self.deduplicated = Metrics.counter(NS, "sentences_deduplicated")
        self.run_stats = RunStats()

    def setup(self):
        loaded = shared_model(self._shared, self.spec)
        self.embedder, self.kernel = loaded.embedder, loaded.kernel
        self.pool = None
        if self.threads > 1 and self.embedder.state_mode != "stateful":
            import torch
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="elmo-embed",
                                           initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))

    def teardown(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    def start_bundle(self):
        self.pending: list[_Job] = []

    def process(self, batch: list[Item]):
        job = _Job(batch, *split_at_window(batch, window_limit(self.window, self.max_tokens)))
        if job.short:
            tokens = [i.tokens for i in job.short]
            try:
                prepared = self.embedder.prepare_packed(tokens)
                if self.pool:
                    job.future = self.pool.submit(self.embedder.embed_packed, tokens, self.layers, prepared)
                else:
                    job.future = Future()
                    job.future.set_result(self.embedder.embed_packed(tokens, self.layers, prepared))
            except Exception:  # noqa: BLE001 - isolate the failing sentence(s), in _finish
                job.single, job.short = job.short, []
        self.pending.append(job)
        while len(self.pending) >= self.threads:
            yield from self._finish(self.pending.pop(0))

    def finish_bundle(self):
        while self.pending:
            for out in self._finish(self.pending.pop(0)):
                yield in_global_window(out)

    def _one_by_one(self, items: list[Item], outs: list[EmbeddedBatch]):
        """Each item embedded alone into outs; those that fail go to DEAD (yielded), with their copies. Not in a
        process that is exiting (worker_exit.check: its teardown shut the pool down, a batch's submit failed, and
        a whole batch one by one kept the exit waiting, past its bound into the abort it prevents)."""
        limit = window_limit(self.window, self.max_tokens)
        for item in items:
            worker_exit.check()
            if limit is not None and len(item.tokens) > limit:
                self.windowed.inc()
            try:
                outs.append(embed_alone(self.embedder, item, self.window, self.overlap, self.max_tokens, self.layers))
            except Exception as e:  # noqa: BLE001
                for each in occurrences(item):
                    self.dead.inc()
                    yield beam.pvalue.TaggedOutput(DEAD, embedding_failed(each, e))

    def _finish(self, job: _Job):
        """The job's EmbeddedBatches (waiting for its biLM thread) and its dead letters."""
        outs = []
        if job.short:
            try:
                outs.append(EmbeddedBatch(job.short, *job.future.result(), self.layers))
            except Exception:  # noqa: BLE001 - isolate the failing sentence(s), below
                job.single = job.short
        yield from self._one_by_one(job.single, outs)
        if job.long:
            try:
                outs += embed_windowed(self.embedder, job.long, self.window, self.overlap, self.max_tokens)
                self.windowed.inc(len(job.long))
            except Exception:  # noqa: BLE001 - isolate the failing sentence(s)
                yield from self._one_by_one(job.long, outs)
        seconds = time.perf_counter() - job.t0
        self.seconds.inc(int(1000 * seconds))
        tokens = sum(int(b.offsets[-1]) for b in outs)
        self.run_stats.time("embed", seconds)
        self.run_stats.embedded(tokens, job.start)
        if self.progress:       # failed sentences' bytes too: their input is done with
            advance(self.progress, sum(c.nbytes for i in job.batch for c in occurrences(i)), tokens)
        for out in outs:
            out = with_copies(dataclasses.replace(out, kernel=self.kernel))
            self.deduplicated.inc(out.copies)
            yield out
