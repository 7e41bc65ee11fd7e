"""Where a run's work runs: the runner, local or not, its worker processes, and what each one runs beside the biLM
(torch threads, tokenizer children, batches at once), how documents are spread (Reshuffle or a keyed GroupByKey)
and DaskRunner's partitions. Settled once by plan() (pipeline/plan.py).
"""
from __future__ import annotations

import os
from typing import NamedTuple

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions  # noqa: E402

from elmo_pipeline.pipeline.options import ElmoOptions, default_torch_threads  # noqa: E402

LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner")
IDENTITY_RESHUFFLE = ("DaskRunner",)    # runners whose Reshuffle moves nothing (apache_beam/runners/dask/overrides.py)
MAX_PARTITIONS = 1024       # DaskRunner partitions chosen from the corpus: one per read element, at most this many
BUCKET_BYTES = 16 << 20     # documents spread by key: at least 4 buckets per partition, and this many bytes of input
                            # per bucket at most on average (a group is held in memory)


def spread_by_key(runner: str) -> bool:
    """Whether documents must be spread by a keyed GroupByKey: the runner's Reshuffle moves nothing."""
    return any(r in runner for r in IDENTITY_RESHUFFLE)


def dask_partitions(opts: PipelineOptions, elements: int) -> int:
    """DaskRunner's partitions of the read elements (the parallelism of every step, Dask running a partition as
    one task): --dask_npartitions when given, else one per read element up to MAX_PARTITIONS, set in `opts` for
    the runner (Beam's own default puts up to 128 elements in one partition: one worker)."""
    from apache_beam.runners.dask.dask_runner import DaskOptions
    d = opts.view_as(DaskOptions)
    if not d.npartitions and not d.partition_size:
        d.npartitions = max(1, min(MAX_PARTITIONS, elements))
    return d.npartitions or max(1, -(-elements // d.partition_size))


def local_workers(opts: PipelineOptions) -> int:
    """The worker processes of a local run: --direct_num_workers in multi_processing mode, else 1."""
    d = opts.view_as(DirectOptions)
    return (d.direct_num_workers or 1) if d.direct_running_mode == "multi_processing" else 1


def tokenizer_processes(flag: str, tokenizer: str, local: bool, runner: str, workers: int = 1) -> int:
    """--tokenizer-process resolved to a number of child processes per worker (0: tokenize inline): the
    cores each worker has, at most 2 and at least 1. auto: only where the tokenizer is costly (not
    whitespace), on local runners with a core beside the biLM. on: ValueError on DaskRunner, which drops the
    Items a child still owes at a bundle's end."""
    if flag == "on" and "DaskRunner" in runner:
        raise ValueError("--tokenizer-process on does not work with DaskRunner (it drops what a step emits "
                         "from finish_bundle: docs/runner-notes.md); use auto or off")
    cores = os.cpu_count() or 1
    if flag == "off" or flag == "auto" and not (local and tokenizer != "whitespace" and cores >= 2):
        return 0
    return max(1, min(2, cores // max(1, workers)))


def embed_threads(flag: int, torch_threads: int, local: bool, state: str, workers: int = 1,
                  tokenizer_children: int = 0) -> int:
    """--embed-threads resolved: the flag when given; auto (0): 2 on a local runner when each worker has a core
    beside its one torch thread that no tokenizer child takes (tokenizing inline) and the state lets batches
    run at once (not stateful), else 1. With tokenizer children on 2 cores, a second biLM thread only adds
    contention (benchmarks/README.md, host cost)."""
    if flag:
        return flag
    cores = os.cpu_count() or 1
    return 2 if (local and state != "stateful" and torch_threads == 1 and not tokenizer_children
                 and cores // max(1, workers) >= 2) else 1


class Where(NamedTuple):
    """How the run is laid out: runner, local or not, worker processes, torch threads."""
    runner: str
    local: bool
    workers: int
    threads: int


def layout_of(opts: PipelineOptions, o: ElmoOptions) -> Where:
    """The runner, whether it runs here, its worker processes and each one's torch threads."""
    runner = opts.view_as(StandardOptions).runner or "FnApiRunner"
    local = runner in LOCAL_RUNNERS
    workers = local_workers(opts)
    return Where(runner, local, workers, o.torch_threads or (default_torch_threads(workers) if local else 0))
