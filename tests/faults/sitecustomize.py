"""Test-only fault injection into real processes: SIGKILL a process the Nth time it reaches a named point, or
slow it there. No hook lives in the product: this module patches the product's classes at start-up, in every
Python process whose PYTHONPATH holds this folder (tests/conftest.py puts it there), and only when asked:

ELMO_PIPELINE_CRASH_AT="embed:3" kills the process (SIGKILL: no cleanup, no finally blocks, exactly like an OOM
kill or a lost machine) the 3rd time it reaches "embed"; several points may be given, comma-separated.
ELMO_PIPELINE_DELAY_AT="embed:0.5" sleeps 0.5 s every time a point is reached (a slow run).

Points: embed (a batch embedded or being embedded, not emitted), stage_shard (a staged shard file written, not
closed, no commit record), commit (a shard's files and commit record written, before the runner has the shard),
finalize_move (a staged file moved to its final name), finalize_manifest (manifest.json written, staging not yet
removed), finalize_cleanup (staging removed, _SUCCESS not yet written), register (--iceberg-table: just before
the table is read and the shards added), registered (added to the table, _SUCCESS not yet written).
"""
import os

CRASH_ENV, DELAY_ENV = "ELMO_PIPELINE_CRASH_AT", "ELMO_PIPELINE_DELAY_AT"


def _targets(env: str, kind) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(env, "").split(","))):
        name, _, n = part.partition(":")
        out[name] = kind(n or 1)
    return out


def _install() -> None:
    import posixpath
    import re
    import signal
    import threading
    import time
    from contextlib import contextmanager

    from elmo_pipeline.output.names import MANIFEST, RECORDS, STAGING
    from elmo_pipeline.output.sink import Sink
    from elmo_pipeline.pipeline.plan import Plan
    from elmo_pipeline.transforms.embed_step import EmbedBatches

    crash, delay = _targets(CRASH_ENV, int), _targets(DELAY_ENV, float)
    counts, lock = {}, threading.Lock()
    staged_file = re.compile(r"[0-9a-f]{32}\.\w+")

    def point(name: str) -> None:
        if name in delay:
            time.sleep(delay[name])
        if name in crash:
            with lock:
                counts[name] = counts.get(name, 0) + 1
                hit = counts[name] == crash[name]
            if hit:
                os.kill(os.getpid(), signal.SIGKILL)

    finish, open_, put, move, remove, register = (EmbedBatches._finish, Sink.open, Sink.put, Sink.move, Sink.remove,
                                                  Plan.register)

    def _finish(self, job):
        point("embed")
        yield from finish(self, job)

    @contextmanager
    def open_file(self, path):
        with open_(self, path) as f:
            yield f
            if staged_file.fullmatch(posixpath.basename(path)):
                point("stage_shard")

    def put_file(self, path, data):
        put(self, path, data)
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

    def register_output(self, manifest, fence=None):
        point("register")
        register(self, manifest, fence)
        point("registered")

    EmbedBatches._finish, Sink.open, Sink.put, Sink.move, Sink.remove, Plan.register = (
        _finish, open_file, put_file, move_file, remove_paths, register_output)


if os.environ.get(CRASH_ENV) or os.environ.get(DELAY_ENV):
    _install()
