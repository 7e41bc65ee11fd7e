"""A worker process's exit while a step's daemon thread runs native code (transforms/worker_exit.py)."""
import os
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
        assert r.stdout.splitlines()[-2:] == ["main returns", "stopped: the worker process is exiting"], r.stdout
