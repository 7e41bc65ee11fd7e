"""Where a run's work runs: the runner, local or not, its worker processes, and what each one runs beside the biLM
(torch threads, tokenizer children, batches at once), how documents are spread (Reshuffle or a keyed GroupByKey)
and DaskRunner's partitions. Settled once by plan() (pipeline/plan.py).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
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


class WorkerLost(RuntimeError):
    """A local worker process of the run (--direct_running_mode multi_processing) exited while the pipeline ran."""


class TasksLost(RuntimeError):
    """DaskRunner: the run's tasks ended without their results (cancelled: the scheduler gone, the cluster restarted)."""


def dask_scheduler_answers(opts: PipelineOptions) -> None:
    """DaskRunner with --dask_client_address (or --dask_scheduler_file): TimeoutError (exit 75) unless the scheduler completes
    distributed's handshake within the connection timeout (--dask_connection_timeout, else distributed's
    `comm.timeouts.connect`). distributed's Client bounds the TCP connect but not the handshake's read: a scheduler
    that accepts connections and never answers (stopped, frozen, or another service on its port) held Beam's
    Client(), so the run, and its lease alive, for good. Called before each round's graph starts."""
    from apache_beam.runners.dask.dask_runner import DaskOptions
    d = opts.view_as(DaskOptions)
    address = d.address
    if not address and d.scheduler_file:
        import json
        try:
            with open(d.scheduler_file) as f:
                address = json.load(f).get("address")
        except (OSError, ValueError, AttributeError):
            return          # Client() says what is wrong with it
    if not address:
        return              # Beam starts a LocalCluster of its own
    import asyncio

    from distributed.comm import connect
    from distributed.security import Security
    timeout = _connect_timeout(opts)

    async def handshake():
        comm = await connect(address, timeout=timeout, **Security().get_connection_args("client"))
        await comm.close()
    try:
        asyncio.run(asyncio.wait_for(handshake(), timeout))
    except asyncio.TimeoutError:
        raise TimeoutError(f"the Dask scheduler at {address} did not answer within {timeout:g} s (it accepts "
                         "connections: stopped, frozen or another service on its port); retry later") from None


def _connect_timeout(opts: PipelineOptions) -> float:
    """Seconds: --dask_connection_timeout, else distributed's `comm.timeouts.connect`."""
    from apache_beam.runners.dask.dask_runner import DaskOptions
    import dask
    from dask.utils import parse_timedelta
    timeout = opts.view_as(DaskOptions).timeout
    return timeout if isinstance(timeout, (int, float)) else \
        parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")


def dask_wait(result, opts: PipelineOptions) -> None:
    """DaskRunner's wait_until_finish(), with the scheduler asked to complete a handshake (dask_scheduler_answers)
    every connection timeout while it waits: the client sees a scheduler that died, not one stopped or frozen (its
    connection stays open), and the run waited for good, its lease alive (every later run 75). TimeoutError (exit 75)
    when it does not answer; then dask_tasks_finished."""
    every = _connect_timeout(opts)
    while True:
        try:
            result.wait_until_finish(duration=max(every, 1) * 1000)
            break
        except TimeoutError:        # distributed's as_completed: its tasks still running
            dask_scheduler_answers(opts)
    dask_tasks_finished(result)


def dask_tasks_finished(result) -> None:
    """After DaskRunner's wait_until_finish(), which ends as DONE when its tasks were cancelled (distributed's
    as_completed yields a cancelled future's CancelledError as its result, unraised: the scheduler gone mid-run, a
    client.restart() or cancel()), so Finalize would publish what was staged so far as the whole output: TasksLost
    unless every task finished. Other runners' results: nothing to check."""
    futures = getattr(result, "futures", None)
    if futures is None:
        return
    futures = list(futures) if isinstance(futures, (list, tuple)) else [futures]
    lost = [f for f in futures if getattr(f, "status", "finished") != "finished"]
    if lost:
        raise TasksLost(f"{len(lost)} of the Dask run's {len(futures)} task(s) ended {lost[0].status} (the scheduler "
                        "gone, or the cluster restarted): their work is lost; rerun the same command, it resumes "
                        "from what was committed")


WORKER_THREAD = "run_worker"      # Beam's thread that starts a local worker process and waits for it (worker_handlers)
WORKER_EXITED = "Worker subprocess exited"      # what that thread raises when the process exits with a status
LOST_SIGNAL = "SIGUSR2"           # sent to the main thread, whose wait for the lost worker's bundle never ends else


@contextmanager
def lost_workers_end_the_run():
    """Around a local run's graph (pipeline/execute.py): a worker process that dies (SIGKILL, OOM) while the pipeline
    runs makes the runner raise WorkerLost at once. Beam's FnApiRunner only notices a lost worker when it was talking
    to it (`Channel closed prematurely`); otherwise it waits for the lost worker's bundle for good, its launcher
    holding the output's lease alive, so every later run exits 75. Beam's thread that waits for the worker process
    raises on its exit status (threading.excepthook sees it); the main thread is then interrupted by a signal whose
    handler raises. And a SIGTERM or SIGINT that the command unwinds from (pipeline/cli.py: a handler that raises)
    ends the local workers first, the watch stopped: Beam's cleanup waits for each worker process to end, and one
    still starting (not yet connected to the runner) is never told to, so the launcher waited for good, its lease
    alive. Outside the main thread (the pipeline run from a caller's thread): nothing is watched."""
    sig = getattr(signal, LOST_SIGNAL)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lost: list[str] = []
    watching, lock = [True], threading.RLock()   # re-entrant: the handler may run in the main thread while it holds it
    main, hook_before = threading.main_thread().ident, threading.excepthook

    def raise_lost(signum, frame):
        with lock:
            if not (lost and watching[0]):
                return
            watching[0] = False         # once: Beam's cleanup below must not be cut short again
        end_local_workers()             # else Beam's cleanup waits for the others, idle, for good
        raise WorkerLost(f"a worker process of the run exited while it ran ({lost[0]}): its bundle is lost; "
                         "rerun the same command, it resumes from what was committed")

    def on_thread_error(args):
        if args.thread is not None and args.thread.name == WORKER_THREAD and WORKER_EXITED in str(args.exc_value):
            with lock:
                if watching[0] and not lost:
                    lost.append(str(args.exc_value))
                    signal.pthread_kill(main, sig)
            return
        hook_before(args)
    def ending(handler):
        def end_then_unwind(signum, frame):
            with lock:
                watching[0] = False     # the workers ended below are no lost worker: the signal's own status
            end_local_workers()
            return handler(signum, frame)
        return end_then_unwind
    unwinding = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    unwinding = {s: h for s, h in unwinding.items() if callable(h)}     # the command's handlers (pipeline/cli.py)
    handler_before = signal.signal(sig, raise_lost)
    for s, h in unwinding.items():
        signal.signal(s, ending(h))
    threading.excepthook = on_thread_error
    try:
        yield
    finally:
        for s, h in unwinding.items():
            signal.signal(s, h)
        with lock:
            watching[0] = False
        threading.excepthook = hook_before
        # the handler before, as it was (SIG_IGN left behind was inherited by every process started later): a signal
        # sent just before, still pending, is taken first, blocked, so that it never meets the default action
        signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
        try:
            while sig in signal.sigpending():
                signal.sigwait({sig})
            signal.signal(sig, signal.SIG_DFL if handler_before is None else handler_before)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux: /proc/<pid>/task/*/children; [] where it cannot be read)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def end_local_workers() -> None:
    """SIGKILL this process's local worker processes (Beam's sdk_worker_main, started through a shell) and every
    process under them (their tokenizer children): what is left of a run that lost one of them."""
    def cmdline(pid: int) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""
    todo = [c for c in _children(os.getpid()) if b"sdk_worker_main" in cmdline(c)]
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
