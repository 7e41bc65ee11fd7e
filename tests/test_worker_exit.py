"""A worker process's exit while a step's daemon thread runs native code (transforms/worker_exit.py)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

CHILD = textwrap.dedent("""
    import threading, time
    import apache_beam as beam, torch
    from elmo_pipeline.transforms.chain import Chain

    class Gemms(beam.DoFn):
        def process(self, x):
            a = torch.full((384, 384), 0.001)
            for _ in range(300):
                a = torch.mm(a, a).clamp_(-1, 1)
            yield x

    torch.set_num_threads(1)
    chain = Chain(None, Gemms())
    chain.setup()                       # as a worker sets its steps up
    def bundle():
        chain.start_bundle()
        try:
            for i in range(10 ** 9):
                list(chain.process(i))
        except RuntimeError as e:
            print("stopped:", e, flush=True)
    threading.Thread(target=bundle, daemon=True).start()     # as Beam's SDK harness runs bundles
    time.sleep(1.0)
    print("main returns", flush=True)                         # the harness's main returns: the process exits
""")


@pytest.mark.slow
def test_a_worker_exiting_while_a_step_runs_native_code_exits_cleanly():
    """The interpreter's teardown ended a daemon thread inside torch as it took the GIL back: "terminate called
    without an active exception", SIGABRT (and a core file where the host keeps them) at the end of an interrupted
    multi-process run. Now the exit waits for the step's work under way, and the step takes no more."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])
        lines = r.stdout.splitlines()       # the thread's own print may be cut by the exit that follows its step
        assert lines[-2] == "main returns" and lines[-1].startswith("stopped:"), r.stdout


def test_a_step_a_failed_bundle_left_suspended_holds_no_exit():
    """A Chain step's generator suspended at a yield when the bundle failed downstream, held by the failure's
    traceback in a reference cycle: still counted as under way, it held the exit for the whole bound."""
    import gc
    import time
    import apache_beam as beam
    from elmo_pipeline.transforms import worker_exit
    from elmo_pipeline.transforms.chain import Chain

    class Twice(beam.DoFn):
        def process(self, x):
            yield x
            yield x
    def bundle(chain):                  # as a runner's bundle loop: its frame, kept by the traceback, holds the step
        outputs = chain.process(1)
        for _ in outputs:
            raise ValueError("downstream failed")           # the step left at its first yield
    chain = Chain(None, Twice())
    chain.start_bundle()
    gc.disable()
    try:
        try:
            bundle(chain)
        except ValueError as e:
            kept = [e, e.__traceback__]
            kept.append(kept)                              # a cycle: freed by a collection only
        del kept
        assert worker_exit._STATE["active"] == 1
        t = time.monotonic()
        worker_exit.settle(limit_s=30)
        assert time.monotonic() - t < 10 and worker_exit._STATE["active"] == 0     # a collection, not the bound
    finally:
        gc.enable()
        worker_exit._STATE["exiting"] = False


EMBEDDING = textwrap.dedent("""
    import atexit, sys, threading, time
    import concurrent.futures.thread as cft
    import torch
    from elmo_pipeline.model.resolve import ModelSpec
    from elmo_pipeline.model.synthetic import write_random_bilm
    from elmo_pipeline.transforms import embed_step
    from elmo_pipeline.transforms.chain import Chain
    from elmo_pipeline.transforms.records import Item

    torch.set_num_threads(1)
    calls, ended = [], []
    real = embed_step.embed_alone
    def counted(*a, **k):
        calls.append(time.monotonic())
        return real(*a, **k)
    embed_step.embed_alone = counted
    # registered before the step's settle, so run after it (atexit: last in, first out)
    atexit.register(lambda: print("alone after the exit began:", sum(t > ended[0] for t in calls), flush=True))
    step = embed_step.EmbedBatches(ModelSpec(*write_random_bilm("tiny", sys.argv[1], seed=1), device="cpu"), threads=2)
    chain = Chain(None, step)
    chain.setup()
    words = "the cat sat on a mat while dogs ran far away".split()
    batch = [Item(f"d#{s}", "d", s, tuple(words[(s + i) % 11] for i in range(40)), tuple((i, i + 1) for i in range(40)))
             for s in range(400)]
    started = threading.Event()
    def bundle():
        chain.start_bundle()
        list(chain.process(batch))                  # a batch on the step's pool
        started.set()
        while not cft._shutdown:                    # the exit's thread shutdown has shut the pool down: the next
            time.sleep(0.001)                       # batch's submit fails (the race this waits for)
        try:
            list(chain.process(batch))              # its submit fails: the job waits for the bundle's end
            list(chain.finish_bundle())             # which retries it sentence by sentence
        except RuntimeError as e:
            print("stopped:", e, flush=True)
    threading.Thread(target=bundle, daemon=True).start()
    started.wait()
    ended.append(time.monotonic())
    print("main returns", flush=True)
""")


@pytest.mark.slow
def test_an_exit_while_batches_run_on_embed_threads_does_not_embed_them_one_by_one(tmp_path):
    """--embed-threads 2: the exit's teardown shuts the step's thread pool down, the next batch's submit fails, and
    the step retried that batch sentence by sentence (its failure path) on the Beam thread: 400 embeddings after the
    exit began, holding the exit's wait (and past its bound, the abort it prevents). Now the retries stop once the
    process exits."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", EMBEDDING, str(tmp_path / "model")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])
    counts = [int(n) for n in re.findall(r"alone after the exit began: (\d+)", r.stdout)]
    assert counts and counts[0] <= 20, r.stdout            # of 400 (the thread's "stopped" print may be cut by the exit)
