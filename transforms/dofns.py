"""Beam shells over plain functions: transforms.read, tokenization, model.batching, transforms.embed, transforms.write.

DoFns that reject elements yield them as TaggedOutput(DEAD, DeadLetter); the graph runs them inside a Chain,
which stages those dead letters instead of passing them on (no multi-output ParDo: see docs/runner-notes.md).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils import shared
from apache_beam.utils.windowed_value import WindowedValue

from formats.layout import EXCERPT_CHARS, DeadLetter, sentence_id
from model.batching import padding, plan_batches
from model.windows import effective_window, embed_long, embed_long_many
from transforms import embed as E
from transforms.faults import crash_point
from transforms.progress import ProgressSpec, advance, split_bytes
from transforms.read import MAX_RECORD_BYTES, read_documents, split_duplicate_ids
from transforms.records import MAX_DOCUMENT_TOKENS, Blank, Document, EmbeddedBatch, Item
from transforms.resume import load_done_ids
from tokenization.process import TokenizerProcesses, tokenize_or_reason
from transforms.stats import RunStats, merge_stats
from transforms.write import ShardSpec, stage_counts, stage_dead_letters, stage_shard, stage_stats

NS = "elmo"
DEAD = "dead"


def _windowed(x):
    return WindowedValue(x, GlobalWindow().max_timestamp(), [GlobalWindow()])


class ReadFiles(beam.DoFn):
    """index of a file in `files` -> Document ...; unreadable records to the DEAD output; per file, its record
    counts (input records, blank records) staged under the run's staging folder (transforms.write.stage_counts).
    The progress bar advances by the file's bytes that no Document carries (blank and unreadable records).
    Files travel by index: a local name that is not valid UTF-8 cannot be a Beam string."""

    def __init__(self, fmt, files, labels, text_field, id_field, storage_options, staging,
                 progress: ProgressSpec | None = None, max_record_bytes: int = MAX_RECORD_BYTES):
        self.args = (fmt, labels, text_field, id_field, storage_options)
        self.files, self.max_record_bytes = list(files), max_record_bytes
        self.staging, self.progress = staging, progress
        self.docs = Metrics.counter(NS, "documents")
        self.dead = Metrics.counter(NS, "dead_letters")
        self.blank = Metrics.counter(NS, "blank_records")
        self.run_stats = RunStats()

    def process(self, index: int):
        fmt, labels, text_field, id_field, so = self.args
        url = self.files[index]
        records = blank = doc_bytes = 0
        busy, t = 0.0, time.perf_counter()      # time reading, not the time downstream steps take per yield
        for rec in read_documents(url, fmt, labels[url], text_field, id_field, so, self.max_record_bytes):
            busy += time.perf_counter() - t
            records += 1
            if isinstance(rec, Blank):
                blank += 1
            elif isinstance(rec, DeadLetter):
                self.dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD, rec)
            else:
                self.docs.inc()
                doc_bytes += rec.nbytes
                yield rec
            t = time.perf_counter()
        busy += time.perf_counter() - t
        self.run_stats.time("read", busy)
        self.blank.inc(blank)
        stage_counts(url, {"input_records": records, "blank_records": blank}, self.staging, so)
        if self.progress:
            advance(self.progress, max(0, self.progress.sizes.get(url, doc_bytes) - doc_bytes))


class DropDuplicateIds(beam.DoFn):
    """(doc id, its Documents) -> the Document when it is the only one; else every one of them to DEAD
    (transforms.read.split_duplicate_ids)."""

    def __init__(self, progress: ProgressSpec | None = None):
        self.dead = Metrics.counter(NS, "dead_letters")
        self.progress = progress

    def process(self, keyed):
        doc_id, docs = keyed[0], list(keyed[1])
        outs = list(split_duplicate_ids(doc_id, docs))
        if self.progress and len(docs) > 1:       # all dead letters: their input is done with
            advance(self.progress, sum(d.nbytes for d in docs))
        for out in outs:
            if isinstance(out, DeadLetter):
                self.dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD, out)
            else:
                yield out


class Tokenize(beam.DoFn):
    """Document -> Item per sentence; sentences over max_tokens to the DEAD output.

    Every document gives at least one sentence: one whose text has no tokens at all (only control
    characters, say), that the tokenizer fails on, or whose sentences hold more than max_document_tokens
    tokens in all, is dead-lettered as its sentence #0.
    processes 0: tokenized inline; N: in N child processes, ahead of this thread, which goes on with the
    steps fused after it (the biLM): tokenization.process. Its last Items come from finish_bundle, so
    only on runners that pass those on (not DaskRunner: docs/runner-notes.md). The run report's "tokenize"
    time is this thread's (with a child: handing documents over and taking sentences back)."""

    def __init__(self, mode: str, max_tokens: int, limit_flag: str = "--max-sentence-tokens",
                 processes: int = 0, progress: ProgressSpec | None = None,
                 max_document_tokens: int = MAX_DOCUMENT_TOKENS):
        self.mode, self.max_tokens, self.limit_flag = mode, max_tokens, limit_flag
        self.max_document_tokens = max_document_tokens
        self.processes, self.progress = processes, progress
        self.sentences = Metrics.counter(NS, "sentences")
        self.tokens = Metrics.counter(NS, "tokens")
        self.dead = Metrics.counter(NS, "dead_letters")
        self.run_stats = RunStats()

    def setup(self):
        self.child = TokenizerProcesses(self.mode, self.processes) if self.processes else None

    def teardown(self):
        if getattr(self, "child", None) is not None:
            self.child.close()

    def start_bundle(self):
        if self.child is not None and (self.child.sent or self.child.chunk):
            self.child.close()      # documents of a bundle that failed: never emitted with this one's
            self.child = TokenizerProcesses(self.mode, self.processes)

    def process(self, doc: Document):
        t0 = time.perf_counter()
        if self.child is None:
            results = [(doc, tokenize_or_reason(doc.text, self.mode, doc.split_sentences))]
        else:
            results = list(self.child.put(doc, doc.text, doc.split_sentences))
        self.run_stats.time("tokenize", time.perf_counter() - t0)
        for d, sentences in results:
            yield from self._items(d, sentences)

    def finish_bundle(self):
        if self.child is not None:
            t0 = time.perf_counter()
            results = list(self.child.drain())
            self.run_stats.time("tokenize", time.perf_counter() - t0)
            for d, sentences in results:
                for out in self._items(d, sentences):
                    yield out if isinstance(out, beam.pvalue.TaggedOutput) else _windowed(out)

    def _items(self, doc: Document, sentences):
        """Items (and dead letters) of `doc` from tokenize_or_reason()'s result."""
        reason = document_reason(sentences, self.max_document_tokens)
        if reason:
            self.sentences.inc()
            self.dead.inc()
            advance(self.progress, doc.nbytes)
            yield beam.pvalue.TaggedOutput(DEAD, DeadLetter(sentence_id(doc.doc_id, 0), reason,
                                                            doc.text[:EXCERPT_CHARS]))
            return
        shares = split_bytes(doc.nbytes, [s.offsets[-1][1] if s.offsets else 0 for s in sentences], len(doc.text)) \
            if self.progress else [0] * len(sentences)
        for i, (s, nbytes) in enumerate(zip(sentences, shares)):
            sid = sentence_id(doc.doc_id, i)
            self.sentences.inc()
            if len(s.tokens) > self.max_tokens:
                self.dead.inc()
                advance(self.progress, nbytes)
                start, end = s.offsets[0][0], s.offsets[-1][1]
                yield beam.pvalue.TaggedOutput(DEAD, DeadLetter(
                    sid, f"too long: {len(s.tokens)} tokens > {self.limit_flag} {self.max_tokens}",
                    doc.text[start:end][:EXCERPT_CHARS]))
                continue
            self.tokens.inc(len(s.tokens))
            yield Item(sid, doc.doc_id, i, s.tokens, s.offsets, nbytes)


def document_reason(sentences, max_document_tokens: int) -> str | None:
    """Why a document's tokenize_or_reason() result (its sentences, or the tokenizer's error) is one dead
    letter, its sentence #0: the tokenizer failed, no tokens, or more tokens than max_document_tokens. None: fine."""
    if isinstance(sentences, str):
        return f"tokenizer failed: {sentences}"[:500]
    if not sentences:
        return "no tokens: the text has no tokens (only control, format or other characters the tokenizer drops)"
    total = sum(len(s.tokens) for s in sentences)
    if total > max_document_tokens:
        return f"too long: document of {total} tokens > --max-document-tokens {max_document_tokens}"
    return None


class Chain(beam.DoFn):
    """DoFns run one after another inside one step, as Beam's fusion would run them: each one's outputs,
    those of its finish_bundle included, go to the next; a TaggedOutput(DEAD, letter) of any of them is staged
    (one file per bundle and 10,000 letters, transforms.write.stage_dead_letters) instead of flowing on.

    So no stage needs a second output (DaskRunner mixes the outputs of a multi-output ParDo) and no element
    has to leave a step from finish_bundle (DaskRunner drops those): what a bundle's end flushes (the last
    sorted batches, the last shard) is handled inside the step. Outputs of the last DoFn from process() are
    the step's outputs; those from its finish_bundle are emitted too, but must not be needed downstream."""

    FLUSH_LETTERS = 10_000

    def __init__(self, staging: str, storage_options, *dofns: beam.DoFn):
        self.staging, self.so, self.dofns = staging, storage_options, dofns

    def setup(self):
        for d in self.dofns:
            d.setup()

    def start_bundle(self):
        self.letters = []
        for d in self.dofns:
            d.start_bundle()
            if hasattr(d, "run_stats"):
                d.run_stats.reset()     # a failed bundle's partial stats are not staged with the next one

    def _flush_letters(self):
        if self.letters:
            letters, self.letters = self.letters, []
            stage_dead_letters(letters, self.staging, self.so)

    def _run(self, outputs, k: int):
        """Pass `outputs` of DoFn k-1 (k = 0: the step's input) through DoFns k.. and yield what comes out."""
        for out in outputs or ():
            if isinstance(out, WindowedValue):
                out = out.value
            if isinstance(out, beam.pvalue.TaggedOutput):
                self.letters.append(out.value)
                if len(self.letters) >= self.FLUSH_LETTERS:
                    self._flush_letters()
            elif k == len(self.dofns):
                yield out
            else:
                yield from self._run(self.dofns[k].process(out), k + 1)

    def process(self, element):
        yield from self._run((element,), 0)

    def finish_bundle(self):
        tail = []
        for k, d in enumerate(self.dofns):
            tail.extend(self._run(d.finish_bundle(), k + 1))
        self._flush_letters()
        parts = [p for p in (d.run_stats.take() for d in self.dofns if hasattr(d, "run_stats")) if p]
        if parts:           # for the run report (transforms/stats.py)
            stage_stats(merge_stats(parts), self.staging, self.so)
        for out in tail:
            yield _windowed(out)

    def teardown(self):
        for d in self.dofns:
            d.teardown()


class SkipCommitted(beam.DoFn):
    """Drops (and counts) the sentences an interrupted run with the same run key already committed.

    The ids come from the commit records prepare_output() kept (transforms/resume.py), loaded once."""

    def __init__(self, record_paths: list[str], storage_options, progress: ProgressSpec | None = None):
        self.record_paths, self.so, self.progress = record_paths, storage_options, progress
        self.skipped = Metrics.counter(NS, "sentences_resumed")

    def setup(self):
        self.done = load_done_ids(self.record_paths, self.so)

    def process(self, item: Item):
        if item.id in self.done:
            self.skipped.inc()
            advance(self.progress, item.nbytes)      # committed by the interrupted run: done
        else:
            yield item


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
            yield _windowed(batch)


class _Holder:
    """Shared needs a weak-referenceable object."""
    def __init__(self, embedder):
        self.embedder = embedder


class _Job:
    """One batch in Embed: its items, the part embedded as one batch (`short`, its result or error once known),
    the sentences over the window (`long`, embedded in windows together) and those embedded one by one
    (`single`: a failed part's), with the batch's start times."""

    def __init__(self, batch: list[Item], short: list[Item], long: list[Item]):
        self.batch, self.short, self.long, self.single = batch, short, long, []
        self.t0, self.start = time.perf_counter(), time.time()
        self.future: Future | None = None


class Embed(beam.DoFn):
    """list[Item] -> EmbeddedBatch (the batch's vectors, packed); the model is loaded once per process (Shared)
    for all threads.

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
    1-torch-thread worker use two cores (benchmarks/host_cost.py)."""

    def __init__(self, spec: E.ModelSpec, progress: ProgressSpec | None = None, window: int = 0, overlap: int = 0,
                 max_tokens: int = 0, layers: tuple[int, ...] | None = None, threads: int = 1):
        self.spec, self.progress, self.layers = spec, progress, layers
        self.window, self.overlap, self.max_tokens = window, overlap, max_tokens
        self.threads = max(1, threads)
        self.windowed = Metrics.counter(NS, "windowed_sentences")
        self._shared = shared.Shared()
        self.seconds = Metrics.counter(NS, "embed_milliseconds")
        self.dead = Metrics.counter(NS, "dead_letters")
        self.run_stats = RunStats()

    def setup(self):
        key = repr(self.spec)
        self.embedder = self._shared.acquire(lambda: _Holder(E.load_embedder(self.spec)), tag=key).embedder
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

    def _embed_one(self, item) -> EmbeddedBatch:
        if self.window and len(item.tokens) > effective_window(self.window, self.max_tokens):
            self.windowed.inc()
            vectors = embed_long(self.embedder, item.tokens, self.window, self.overlap, self.max_tokens)
            return EmbeddedBatch([item], vectors, np.array([0, len(item.tokens)], dtype=np.int64))
        return EmbeddedBatch([item], *self.embedder.embed_packed([item.tokens], self.layers), self.layers)

    def process(self, batch: list[Item]):
        limit = effective_window(self.window, self.max_tokens) if self.window else None
        job = _Job(batch, [i for i in batch if limit is None or len(i.tokens) <= limit],
                   [i for i in batch if limit is not None and len(i.tokens) > limit])   # windowed
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
                yield _windowed(out)

    def _one_by_one(self, items: list[Item], outs: list[EmbeddedBatch]):
        """Each item embedded alone into outs; those that fail go to DEAD (yielded)."""
        for item in items:
            try:
                outs.append(self._embed_one(item))
            except Exception as e:  # noqa: BLE001
                self.dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD, DeadLetter(
                    item.id, f"embedding failed: {type(e).__name__}: {e}"[:500], " ".join(item.tokens)[:EXCERPT_CHARS]))

    def _finish(self, job: _Job):
        """The job's EmbeddedBatches (waiting for its biLM thread) and its dead letters."""
        crash_point("embed")       # the k-th time: the k-th batch is embedded (or being embedded), not emitted
        outs = []
        if job.short:
            try:
                outs.append(EmbeddedBatch(job.short, *job.future.result(), self.layers))
            except Exception:  # noqa: BLE001 - isolate the failing sentence(s), below
                job.single = job.short
        yield from self._one_by_one(job.single, outs)
        if job.long:
            try:
                vectors = embed_long_many(self.embedder, [i.tokens for i in job.long], self.window, self.overlap,
                                          self.max_tokens)
                self.windowed.inc(len(job.long))
                outs += [EmbeddedBatch([i], v, np.array([0, len(i.tokens)], dtype=np.int64))
                         for i, v in zip(job.long, vectors)]
            except Exception:  # noqa: BLE001 - isolate the failing sentence(s)
                yield from self._one_by_one(job.long, outs)
        seconds = time.perf_counter() - job.t0
        self.seconds.inc(int(1000 * seconds))
        tokens = sum(int(b.offsets[-1]) for b in outs)
        self.run_stats.time("embed", seconds)
        self.run_stats.embedded(tokens, job.start)
        if self.progress:       # failed sentences' bytes too: their input is done with
            advance(self.progress, sum(i.nbytes for i in job.batch), tokens)
        yield from outs


class WriteShards(beam.DoFn):
    """EmbeddedBatch -> staged shard files -> ShardInfo. A shard ends at `shard_sentences` sentences, at
    `shard_bytes` of buffered vectors as stored (so memory is bounded whatever the model's width), or at
    the bundle's end; a batch may be split between two shards.

    A full shard is written by threads of this DoFn's own while the Beam thread goes on embedding: at most
    WRITERS shards are being written and one is filling (memory: (WRITERS + 1) x --shard-bytes). Two writers
    keep both cores of a 2-core worker busy when a shard's writing takes about as long as its embedding
    (benchmarks/host_cost.py). The writers do mostly C work that releases the GIL: Parquet encoding,
    HDF5, file and object-store I/O. The biLM runs on the Beam thread or on Embed's threads."""

    WRITERS = 2

    def __init__(self, staging: str, spec: ShardSpec, shard_sentences: int, storage_options, shard_bytes=64 << 20):
        self.staging, self.spec = staging, spec
        self.shard_sentences, self.shard_bytes, self.so = shard_sentences, shard_bytes, storage_options
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
            self.writing.append(self.pool.submit(_timed, stage_shard, sentences, self.staging, self.spec, self.so))

    def process(self, batch: EmbeddedBatch):
        for b in range(len(batch.items)):
            self.buf.append((batch, b))
            self.nbytes += batch.tokens(b) * self.per_token
            if len(self.buf) >= self.shard_sentences or self.nbytes >= self.shard_bytes:
                yield from self._flush()

    def finish_bundle(self):
        for info in [*self._flush(), *self._written()]:
            yield _windowed(info)


def _timed(fn, *args):
    """(fn(*args), its wall seconds): on a writer thread, so the stats are added on the Beam thread."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0
