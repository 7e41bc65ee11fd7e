"""Test-only fault injection into real processes: SIGKILL a process the Nth time it reaches a named point, or
slow it there. No hook lives in the product: this module patches the product's classes at start-up, in every
Python process whose PYTHONPATH holds this folder (tests/conftest.py puts it there), and only when asked:

ELMO_PIPELINE_CRASH_AT="embed:3" kills the process (SIGKILL: no cleanup, no finally blocks, exactly like an OOM
kill or a lost machine) the 3rd time it reaches "embed"; several points may be given, comma-separated.
ELMO_PIPELINE_DELAY_AT="embed:0.5" sleeps 0.5 s every time a point is reached (a slow run).
ELMO_PIPELINE_HOLD_AT="embed:/tmp/go" waits at the point until the file /tmp/go exists (at most 10 minutes): a run
held alive until the test lets it go.

Points: embed (a batch embedded or being embedded, not emitted), stage_shard (a staged shard file written, not
closed, no commit record), commit (a shard's files and commit record written, before the runner has the shard),
finalize_move (a staged file moved to its final name), finalize_manifest (manifest.json written, staging not yet
removed), finalize_cleanup (staging removed, _SUCCESS not yet written), register (--iceberg-table: just before
the table is read and the shards added), registered (added to the table, _SUCCESS not yet written).
"""
import os

CRASH_ENV, DELAY_ENV, HOLD_ENV = "ELMO_PIPELINE_CRASH_AT", "ELMO_PIPELINE_DELAY_AT", "ELMO_PIPELINE_HOLD_AT"


def _targets(env: str, kind) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(env, "").split(","))):
        name, _, n = part.partition(":")
        out[name] = kind(n or 1)
    return out


def _install() -> None:
    """Patch each class when its module is first imported (a process that never imports it, e.g. a tokenizer child,
    pays nothing: importing the pipeline here would cost every child process Beam's and torch's import)."""
    import posixpath
    import re
    import signal
    import threading
    import time
    from contextlib import contextmanager

    crash, delay, hold = _targets(CRASH_ENV, int), _targets(DELAY_ENV, float), _targets(HOLD_ENV, str)
    counts, lock = {}, threading.Lock()
    staged_file = re.compile(r"[0-9a-f]{32}\.\w+")

    def point(name: str) -> None:
        if name in delay:
            time.sleep(delay[name])
        if name in hold:
            t0 = time.time()
            while not os.path.exists(hold[name]) and time.time() - t0 < 600:
                time.sleep(0.05)
        if name in crash:
            with lock:
                counts[name] = counts.get(name, 0) + 1
                hit = counts[name] == crash[name]
            if hit:
                os.kill(os.getpid(), signal.SIGKILL)

    def embed_step(module) -> None:
        finish = module.EmbedBatches._finish

        def _finish(self, job):
            point("embed")
            yield from finish(self, job)
        module.EmbedBatches._finish = _finish

    def sink(module) -> None:
        from elmo_pipeline.output.names import MANIFEST, RECORDS, STAGING
        Sink = module.Sink
        open_, put, move, remove = Sink.open, Sink.put, Sink.move, Sink.remove

        @contextmanager
        def open_file(self, path):
            with open_(self, path) as f:
                yield f
                if staged_file.fullmatch(posixpath.basename(path)):
                    point("stage_shard")

        def put_file(self, path, data, **kwargs):
            put(self, path, data, **kwargs)
            if posixpath.basename(posixpath.dirname(path)) == RECORDS:
                point("commit")
            elif posixpath.basename(path) == MANIFEST:
                point("finalize_manifest")

        def move_file(self, src, dst):
            move(self, src, dst)
            point("finalize_move")

        def remove_paths(self, paths, recursive=False):
            remove(self, paths, recursive)
            if recursive and isinstance(paths, str) and posixpath.basename(posixpath.dirname(paths)) == STAGING:
                point("finalize_cleanup")
        Sink.open, Sink.put, Sink.move, Sink.remove = open_file, put_file, move_file, remove_paths

    def plan(module) -> None:
        register = module.Plan.register

        def register_output(self, manifest, fence=None, **kwargs):
            point("register")
            register(self, manifest, fence, **kwargs)
            point("registered")
        module.Plan.register = register_output

    _after_import({"elmo_pipeline.transforms.embed_step": embed_step, "elmo_pipeline.output.sink": sink,
                   "elmo_pipeline.pipeline.plan": plan})


def _after_import(patches: dict) -> None:
    """Run patches[name](module) right after module `name` is first executed in this process."""
    import importlib.abc
    import sys

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in patches:
                return None
            for finder in sys.meta_path:
                spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
                if spec is not None and spec.loader is not None:
                    break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patches.pop(name)(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchAfterImport())


if os.environ.get(CRASH_ENV) or os.environ.get(DELAY_ENV) or os.environ.get(HOLD_ENV):
    _install()
