"""The tokenizing step's Beam shell: Tokenize (tokenization, its child processes, transforms.sentences)."""
from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.metrics import Metrics

from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.tokenization.process import TokenizerProcesses, tokenize_or_reason
from elmo_pipeline.transforms.chain import DEAD, NS, in_global_window
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.records import MAX_DOCUMENT_TOKENS, Document
from elmo_pipeline.transforms.sentences import sentence_items
from elmo_pipeline.output.stats import RunStats


class Tokenize(beam.DoFn):
    """Document -> Item per sentence; sentences over max_tokens, and documents that are one dead letter
    (transforms.sentences.sentence_items), to the DEAD output.
    processes 0: tokenized inline; N: in N child processes, ahead of this thread, which goes on with the
    steps fused after it (the biLM): tokenization.process. Its last Items come from finish_bundle, so
    only on runners that pass those on (not DaskRunner: docs/runner-notes.md). The run report's "tokenize"
    time is this thread's (with a child: handing documents over and taking sentences back)."""

    def __init__(self, mode: str, max_tokens: int, limit_flag: str = "--max-sentence-tokens",
                 processes: int = 0, progress: ProgressSpec | None = None,
                 max_document_tokens: int = MAX_DOCUMENT_TOKENS, key_prefix: str | None = None):
        self.mode, self.max_tokens, self.limit_flag = mode, max_tokens, limit_flag
        self.key_prefix = key_prefix        # each Item's sentence key, computed here once (transforms.sentences)
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
                    yield out if isinstance(out, beam.pvalue.TaggedOutput) else in_global_window(out)

    def _items(self, doc: Document, sentences):
        """Items (and dead letters) of `doc` from tokenize_or_reason()'s result (transforms.sentences)."""
        for out, nbytes in sentence_items(doc, sentences, self.max_tokens, self.max_document_tokens,
                                          self.limit_flag, share_bytes=bool(self.progress),
                                          key_prefix=self.key_prefix):
            self.sentences.inc()
            if isinstance(out, DeadLetter):
                self.dead.inc()
                advance(self.progress, nbytes)
                yield beam.pvalue.TaggedOutput(DEAD, out)
            else:
                self.tokens.inc(len(out.tokens))
                yield out
