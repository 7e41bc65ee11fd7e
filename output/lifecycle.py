"""A run's life over its output, top to bottom, with the graph run passed in (no Beam here).

run(): a finished output of the same run key is 'complete' (registered in a table newly named, under the lease);
else, under the output's lease (output/lease.py), rounds of: prepare_output() (output/state.py: fresh, resume,
finalize or complete), the graph run for what is missing, plan_from_staging() and finalize()
(output/finalize.py). A round that left sentences unwritten is followed by another, at most MAX_ROUNDS.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from elmo_pipeline.formats.layout import read_manifest
from elmo_pipeline.fsio import url_fs
from elmo_pipeline.output.lease import Lease, RetryLater
from elmo_pipeline.output import manifest as manifests
from elmo_pipeline.output.finalize import Incomplete, complete_finalize, finalize, plan_from_staging
from elmo_pipeline.output.names import LEASE
from elmo_pipeline.output.state import OutputState, is_complete, prepare_output

logger = logging.getLogger("elmo-pipeline.run")
MAX_ROUNDS = 3


@dataclass
class Job:
    """What the output's life needs of a planned run (pipeline/plan.py Plan.job())."""
    output: str
    key: str                        # the run key (output/state.py run_key)
    ingredients: dict               # what it hashes (run.json)
    manifest: dict                  # manifest.json as planned (output/manifest.py planned)
    files: list[str]                # the expanded inputs: each must have its record counts staged
    storage_options: dict
    overwrite: bool = False
    resumable: bool = True          # False: --state stateful keeps no commit record of an interrupted run
    lease_stale_seconds: float = 0
    register: Callable | None = None    # register(manifest, fence, verify=False): --iceberg-table (output/register.py)
    upsert: object = None           # formats.iceberg.upsert.Upsert: its state file staged by Finalize
    kernel_path: dict | None = None  # what the workers compute on (model/kernels.py; None: a remote runner's)


@dataclass
class Outcome:
    """run()'s answer: 'complete' (a finished output of this key: nothing embedded), 'finalize' (only an
    interrupted Finalize was finished) or 'ran' (the graph ran: `result` is what run_graph returned for the round
    that completed; `first` the first round's state, what it resumed)."""
    action: str
    manifest: dict | None
    first: OutputState | None = None
    result: object = None


def lease_url(output: str) -> str:
    return output.rstrip("/") + "/" + LEASE


def run(job: Job, run_graph: Callable[[OutputState, Lease], object]) -> Outcome:
    """The output's life for `job`; run_graph(state, lease) runs the pipeline for what `state` leaves to do,
    fenced by the lease, and returns the runner's result."""
    so = job.storage_options
    if not job.overwrite and is_complete(job.output, job.key, so):
        outcome = Outcome("complete", _manifest(job))
        if job.register is not None:          # e.g. --iceberg-table newly given: registered now, once, under the
            with Lease(lease_url(job.output), job.lease_stale_seconds, so) as lease:   # lease (no run replacing it)
                if not is_complete(job.output, job.key, so):
                    raise RetryLater(f"{job.output} changed while this run waited for its lease; rerun")
                job.register(outcome.manifest, lease.check_held, verify=True)    # its files checked first
        return outcome
    with Lease(lease_url(job.output), job.lease_stale_seconds, so) as lease:
        return rounds(job, lambda state: run_graph(state, lease), lease.check_held)


def rounds(job: Job, run_graph: Callable[[OutputState], object], fence: Callable[[], None]) -> Outcome:
    """Under the lease (`fence`: its check): prepare the output, run the graph (again, for what is missing, if a
    round left sentences unwritten), then finalize from what is staged."""
    so = job.storage_options
    first, started = None, time.time()
    for _ in range(MAX_ROUNDS):
        state = prepare_output(job.output, job.key, job.ingredients, job.overwrite, so, resumable=job.resumable,
                               kernel_path=job.kernel_path, writes_state=job.upsert is not None, fence=fence)
        first = first or state
        if state.action == "complete":         # finished by another run meanwhile
            done = Outcome("complete", _manifest(job))
            if job.register is not None:
                job.register(done.manifest, fence, verify=True)
            return done
        if state.action == "finalize":
            return Outcome("finalize", complete_finalize(job.output, state.staging, so, job.register, fence))
        result = run_graph(state)
        try:
            staged = plan_from_staging(state.staging, job.files, so)
        except Incomplete as e:
            logger.warning("%s; another round embeds them", e)
            continue
        manifest = dict(job.manifest, run=manifests.run_section(job.key, first.records))
        manifest = finalize(job.output, state.staging, staged, manifest, so, job.register,
                            run_seconds=time.time() - started, fence=fence, upsert=job.upsert)
        return Outcome("ran", manifest, first, result)
    raise RetryLater(f"{job.output}: sentences still missing after {MAX_ROUNDS} rounds; rerun the same command")


def _manifest(job: Job) -> dict:
    return read_manifest(*url_fs(job.output, job.storage_options)) or {}
