"""The output lease (fsio/lease.py) on local files: created once, refused while live, taken over when
stale (old heartbeat, or a dead process of this host), lost when someone else takes it."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from fsio.lease import Lease, LeaseHeld, is_stale


def _write(path, **holder):
    with open(path, "w") as f:
        json.dump({"token": "other", "host": "elsewhere", "pid": 1, "pidns": "", "start": time.time(), **holder}, f)


def test_one_holder_then_the_next(tmp_path):
    url = str(tmp_path / "out" / "_lease.json")
    a = Lease(url, stale_seconds=30).acquire()
    assert json.load(open(url))["pid"] == os.getpid()
    with pytest.raises(LeaseHeld, match=f"held by a live run: pid {os.getpid()} on host {socket.gethostname()}"):
        Lease(url, stale_seconds=30).acquire()
    a.release()
    assert not os.path.exists(url)
    with Lease(url, stale_seconds=30) as b:
        assert json.load(open(url))["token"] == b.me["token"]
    assert not os.path.exists(url)


def test_stale_heartbeat_is_taken_over_fresh_is_not(tmp_path):
    url = str(tmp_path / "_lease.json")
    _write(url, heartbeat=time.time() - 5)
    with pytest.raises(LeaseHeld, match="last heartbeat 5 s ago"):
        Lease(url, stale_seconds=30).acquire()
    _write(url, heartbeat=time.time() - 31)
    lease = Lease(url, stale_seconds=30).acquire()
    assert lease.taken_over["host"] == "elsewhere" and json.load(open(url))["token"] == lease.me["token"]
    lease.release()


@pytest.mark.slow   # starts a process
def test_a_dead_process_of_this_host_is_stale_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from fsio.lease import _machine, _pidns
    holder = {"host": socket.gethostname(), "machine": _machine(), "pidns": _pidns(), "pid": dead.pid,
              "heartbeat": time.time()}
    assert is_stale(holder, 3600)
    assert not is_stale(dict(holder, pid=os.getpid()), 3600)
    assert not is_stale(dict(holder, host="elsewhere"), 3600)      # another machine: only the heartbeat tells


def test_heartbeat_refreshes_and_notices_a_takeover(tmp_path):
    url = str(tmp_path / "_lease.json")
    lease = Lease(url, stale_seconds=1, heartbeat_seconds=0.1).acquire()
    first = json.load(open(url))["heartbeat"]
    time.sleep(0.5)
    assert json.load(open(url))["heartbeat"] > first and not lease.lost.is_set()
    _write(url, heartbeat=time.time())          # someone took it over (we looked stale to them)
    for _ in range(50):
        if lease.lost.is_set():
            break
        time.sleep(0.05)
    assert lease.lost.is_set()
    lease.release()
    assert json.load(open(url))["token"] == "other"     # release leaves another holder's lease alone
