"""A planned run: its output's life (output/lifecycle.py: fresh / resume / finish a finalize, rounds, Finalize)
with the Beam graph (pipeline/graph.py) as the run it is handed. The results when no pipeline had to run:
NoPipeline, FinalizeOnly, AlreadyComplete.
"""
from __future__ import annotations

import logging

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from elmo_pipeline.output.lease import Lease, RetryLater
from elmo_pipeline.output import lifecycle
from elmo_pipeline.output.state import OutputState
from elmo_pipeline.pipeline.exits import after_plan
from elmo_pipeline.pipeline.graph import build
from elmo_pipeline.pipeline.plan import Plan
from elmo_pipeline.pipeline.workers import dask_scheduler_answers, dask_wait, lost_workers_end_the_run

logger = logging.getLogger("elmo-pipeline.run")


def run_planned(opts: PipelineOptions, pl: Plan):
    """After plan(): 'already complete', or the run under the output's lease. A failure here is marked
    after_plan() (pipeline/exits.py: a ValueError now is no bad flag)."""
    try:
        outcome = lifecycle.run(pl.job(), lambda state, lease: run_graph(opts, pl, state, lease))
    except Exception as e:
        after_plan(e)
        raise
    if outcome.action == "complete":
        return AlreadyComplete(outcome.manifest)
    if outcome.action == "finalize":
        return FinalizeOnly(outcome.manifest)
    result = outcome.result
    result.manifest = outcome.manifest
    result.resumed_tokens = sum(r["tokens"] for r in outcome.first.records)
    return result


def run_graph(opts: PipelineOptions, pl: Plan, state: OutputState, lease: Lease):
    """One round: the graph for what `state` leaves to do, run to its end, every write fenced by `lease`."""
    p = beam.Pipeline(options=opts)
    build(p, pl, state, lease.fence())
    try:
        with lost_workers_end_the_run():
            dask = "DaskRunner" in str(opts.view_as(StandardOptions).runner)
            if dask:
                dask_scheduler_answers(opts)
            result = p.run()
            try:
                if dask:
                    dask_wait(result, opts)
                else:
                    result.wait_until_finish()
            finally:
                if getattr(result, "client", None) is not None:      # DaskRunner: its connection to the cluster
                    result.client.close()
    except Exception:
        lease.check_held()      # a worker fenced off (LeaseLost): the run lost its lease, not a failure
        raise
    if lease.lost.is_set():
        raise RetryLater(f"lost the lease on {pl.options.output} to another run while running; that run now "
                         "owns the output (this run's staged work is left for it)")
    return result


class NoPipeline:
    """run()'s result when no pipeline had to run."""
    state = "DONE"

    def __init__(self, manifest: dict | None):
        self.manifest = manifest or {}

    def wait_until_finish(self):
        return self.state

    def metrics(self):
        from apache_beam.runners.direct.direct_metrics import DirectMetrics
        return DirectMetrics()


class FinalizeOnly(NoPipeline):
    """Only an interrupted Finalize was left to do."""


class AlreadyComplete(NoPipeline):
    """--output already held the finished run of the same command: nothing was done."""
