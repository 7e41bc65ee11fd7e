"""A planned run under the output's lease (fsio/lease.py): prepare_output() decides fresh / resume / finish a
finalize; the graph (pipeline/graph.py) runs, again for what is missing when sentences were left unwritten, at
most MAX_ROUNDS times; then Finalize runs here, from what is staged (output/finalize.py). The results when
no pipeline had to run: NoPipeline, FinalizeOnly, AlreadyComplete.
"""
from __future__ import annotations

import logging
import time

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from elmo_pipeline.formats import layout
from elmo_pipeline.fsio import url_fs
from elmo_pipeline.fsio.lease import Lease, RetryLater
from elmo_pipeline.output.names import LEASE
from elmo_pipeline.pipeline.exits import after_plan
from elmo_pipeline.pipeline.graph import build
from elmo_pipeline.pipeline.plan import Plan
from elmo_pipeline.output.finalize import Incomplete, complete_finalize, finalize, plan_from_staging
from elmo_pipeline.output.state import is_complete, prepare_output

logger = logging.getLogger("elmo-pipeline.run")

MAX_ROUNDS = 3


def lease_url(output: str) -> str:
    return output.rstrip("/") + "/" + LEASE


def run_planned(opts: PipelineOptions, pl: Plan):
    """After plan(): 'already complete', or the run under the output's lease. A failure here is marked
    after_plan() (pipeline/exits.py: a ValueError now is no bad flag)."""
    o, so = pl.options, pl.storage_options
    try:
        if not o.overwrite and is_complete(o.output, pl.key, so):
            result = AlreadyComplete(_manifest(pl))
            if pl.iceberg is not None:        # e.g. --iceberg-table newly given: registered now, once, under the
                with Lease(lease_url(o.output), o.lease_stale_seconds, so) as lease:  # lease (no run replacing it)
                    if not is_complete(o.output, pl.key, so):
                        raise RetryLater(f"{o.output} changed while this run waited for its lease; rerun")
                    pl.register(result.manifest, lease.check_held)
        else:
            with Lease(lease_url(o.output), o.lease_stale_seconds, so) as lease:
                result = run_under_lease(opts, pl, lease)
    except Exception as e:
        after_plan(e)
        raise
    return result


def _manifest(pl: Plan) -> dict:
    fs, root = url_fs(pl.options.output, pl.storage_options)
    return layout.read_manifest(fs, root) or {}


def run_under_lease(opts: PipelineOptions, pl: Plan, lease: Lease):
    """Under the lease: prepare --output, run the graph (again, for what is missing, if a round left
    sentences unwritten), then finalize from what is staged."""
    o, so = pl.options, pl.storage_options
    first, started = None, time.time()
    for _ in range(MAX_ROUNDS):
        state = prepare_output(o.output, pl.key, pl.ingredients, o.overwrite, so, resumable=o.state != "stateful")
        first = first or state
        if state.action == "complete":         # finished by another run meanwhile
            done = AlreadyComplete(_manifest(pl))
            if pl.iceberg is not None:
                pl.register(done.manifest, lease.check_held)
            return done
        if state.action == "finalize":
            return FinalizeOnly(complete_finalize(o.output, state.staging, so, pl.registrar, lease.check_held))
        p = beam.Pipeline(options=opts)
        build(p, pl, state, lease.fence())
        try:
            result = p.run()
            try:
                result.wait_until_finish()
            finally:
                if getattr(result, "client", None) is not None:      # DaskRunner: its connection to the cluster
                    result.client.close()
        except Exception:
            lease.check_held()      # a worker fenced off (LeaseLost): the run lost its lease, not a failure
            raise
        if lease.lost.is_set():
            raise RetryLater(f"lost the lease on {o.output} to another run while running; that run now "
                             "owns the output (this run's staged work is left for it)")
        try:
            staged = plan_from_staging(state.staging, pl.files, so)
        except Incomplete as e:
            logger.warning("%s; another round embeds them", e)
            continue
        manifest = dict(pl.manifest, run={"key": pl.key, "resumed_shards": len(first.records),
                                          "resumed_sentences": first.sentences})
        result.manifest = finalize(o.output, state.staging, staged, manifest, so, pl.registrar,
                                   run_seconds=time.time() - started, fence=lease.check_held, upsert=pl.upsert)
        result.resumed_tokens = sum(r["tokens"] for r in first.records)
        return result
    raise RetryLater(f"{o.output}: sentences still missing after {MAX_ROUNDS} rounds; rerun the same command")


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
