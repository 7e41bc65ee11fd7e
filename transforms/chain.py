"""Chain: DoFns run one after another inside one Beam step, their dead letters staged instead of passed on.

DoFns that reject elements yield them as TaggedOutput(DEAD, DeadLetter); the graph runs them inside a Chain,
which stages those dead letters instead of passing them on (no multi-output ParDo: see docs/runner-notes.md).
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from elmo_pipeline.output.stats import merge_stats
from elmo_pipeline.output.staging import Staging
from elmo_pipeline.transforms.logs import worker_logs
from elmo_pipeline.transforms import worker_exit

NS = "elmo"         # the Beam metrics namespace of every step
DEAD = "dead"       # the tag of a rejected element's DeadLetter


def in_global_window(x):
    """An element emitted from finish_bundle (which has no element to take a window from)."""
    return WindowedValue(x, GlobalWindow().max_timestamp(), [GlobalWindow()])


class Chain(beam.DoFn):
    """DoFns run one after another inside one step, as Beam's fusion would run them: each one's outputs,
    those of its finish_bundle included, go to the next; a TaggedOutput(DEAD, letter) of any of them is staged
    (one file per bundle and 10,000 letters, output.staging.Staging.dead_letters) instead of flowing on.

    So no stage needs a second output (DaskRunner mixes the outputs of a multi-output ParDo) and no element
    has to leave a step from finish_bundle (DaskRunner drops those): what a bundle's end flushes (the last
    sorted batches, the last shard) is handled inside the step. Outputs of the last DoFn from process() are
    the step's outputs; those from its finish_bundle are emitted too, but must not be needed downstream."""

    FLUSH_LETTERS = 10_000

    def __init__(self, staging: Staging, *dofns: beam.DoFn):
        self.staging, self.dofns = staging, dofns

    def setup(self):
        worker_logs()           # a worker process's log lines redacted, as the launcher's
        worker_exit.settle_at_exit()    # its exit waits for its threads' native work
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
            self.staging.dead_letters(letters)

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
        with worker_exit.working():
            yield from self._run((element,), 0)

    def finish_bundle(self):
        tail = []
        with worker_exit.working():
            for k, d in enumerate(self.dofns):
                tail.extend(self._run(d.finish_bundle(), k + 1))
            self._flush_letters()
            parts = [p for p in (d.run_stats.take() for d in self.dofns if hasattr(d, "run_stats")) if p]
            if parts:           # for the run report (output/stats.py)
                self.staging.stats(merge_stats(parts))
        for out in tail:
            yield in_global_window(out)

    def teardown(self):
        for d in self.dofns:
            d.teardown()
