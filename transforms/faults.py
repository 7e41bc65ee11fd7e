"""Test-only fault hooks: SIGKILL this process at the Nth time it reaches a named point, or slow it there.

ELMO_PIPELINE_CRASH_AT="embed:3" kills the process (os.kill(getpid(), SIGKILL): no cleanup, no
finally blocks, exactly like an OOM kill or a lost machine) the 3rd time crash_point("embed") runs in
it; several points may be given, comma-separated. Unset (always, outside tests) it costs a dict lookup.
Points: embed (before a batch is embedded), stage_shard (a shard's Parquet file half written),
commit (a shard's files and commit record written, before the runner has the shard), finalize_move
(after a staged file was moved to its final name), finalize_manifest (manifest.json written, staging not
yet removed), finalize_cleanup (staging removed, _SUCCESS not yet written), register (--iceberg-table: just before the
table is read and the shards added), registered (added to the table, _SUCCESS not yet written).
ELMO_PIPELINE_DELAY_AT="embed:0.5" sleeps 0.5 s every time a point is reached (a slow run, for tests of
concurrent runs).
"""
from __future__ import annotations

import os
import signal
import threading
import time

CRASH_ENV = "ELMO_PIPELINE_CRASH_AT"
DELAY_ENV = "ELMO_PIPELINE_DELAY_AT"
_counts: dict[str, int] = {}
_lock = threading.Lock()


def _targets(env: str = CRASH_ENV, kind=int) -> dict:
    spec = os.environ.get(env, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition(":")
        out[name] = kind(n or 1)
    return out


def crash_point(name: str) -> None:
    """SIGKILL this process when ELMO_PIPELINE_CRASH_AT names `name` and this is its Nth occurrence here;
    sleep when ELMO_PIPELINE_DELAY_AT names it."""
    if DELAY_ENV in os.environ and name in _targets(DELAY_ENV, float):
        time.sleep(_targets(DELAY_ENV, float)[name])
    if CRASH_ENV not in os.environ:
        return
    target = _targets().get(name)
    if target is None:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == target
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
