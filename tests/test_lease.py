"""The output lease (output/lease.py) on local files: created once, refused while live, taken over when
stale (old heartbeat, or a dead process of this host), lost when someone else takes it."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from elmo_pipeline.output.lease import Lease, LeaseHeld, is_stale


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
    me = Lease(str(tmp_path / "_lease.json")).me          # what this machine writes in a lease
    holder = dict({k: me[k] for k in ("host", "machine", "pidns") if k in me}, pid=dead.pid, heartbeat=time.time())
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


DAMAGED = [b'{"heartbeat": "abc"}', b"[]", b'{"heartbeat": null}', b"not JSON at all", b'{"heartbeat": NaN}',
           b'{"heartbeat": true}', b'"a string"', b"null",
           b'{"heartbeat": 1e20, "token": "t", "host": "elsewhere", "pid": 1, "start": 0}']


@pytest.mark.parametrize("body", DAMAGED, ids=lambda b: b.decode()[:24])
def test_a_damaged_lease_is_held_while_the_object_is_fresh_and_taken_over_once_it_is_old(tmp_path, body):
    """An edited or damaged lease object (not JSON, not an object, a heartbeat that is no finite number or lies
    far in the future) never crashes a run nor jams the output: its age is the object's modification time."""
    url = str(tmp_path / "_lease.json")
    with open(url, "wb") as f:
        f.write(body)
    with pytest.raises(LeaseHeld, match="without a usable heartbeat|in the future"):
        Lease(url, stale_seconds=30).acquire()
    old = time.time() - 31
    os.utime(url, (old, old))
    lease = Lease(url, stale_seconds=30).acquire()
    assert json.load(open(url))["token"] == lease.me["token"]
    lease.release()
    assert not os.path.exists(url)


def test_another_machine_of_the_same_host_name_is_judged_by_its_heartbeat_alone(tmp_path):
    """The dead-process rule holds only on this machine: a lease written by a process of another machine that
    has the same host name and pid-namespace inode (the same number on every Linux host) is not stale while
    its heartbeat is fresh, even though no process of that pid exists here."""
    with open("/proc/sys/kernel/pid_max") as f:
        no_such_pid = int(f.read()) + 1
    me = Lease(str(tmp_path / "_lease.json")).me          # what this machine writes in a lease
    here = dict({k: me[k] for k in ("host", "machine", "pidns") if k in me}, pid=no_such_pid, heartbeat=time.time())
    assert is_stale(here, 3600)
    assert not is_stale(dict(here, machine="another-machine"), 3600)
    assert not is_stale({k: v for k, v in here.items() if k != "machine"}, 3600)    # written without one


def test_check_held_stops_once_another_run_took_the_lease(tmp_path):
    """The token is a fencing token: check_held() reads it back and raises RetryLater once the lease object
    carries another run's token, or is gone."""
    from elmo_pipeline.output.lease import RetryLater
    url = str(tmp_path / "_lease.json")
    lease = Lease(url, stale_seconds=30).acquire()
    lease.check_held()
    _write(url, heartbeat=time.time())          # taken over (it looked stale to another run)
    with pytest.raises(RetryLater, match="lost the lease"):
        lease.check_held()
    assert lease.lost.is_set()
    lease.release()
    assert json.load(open(url))["token"] == "other"
    again = Lease(url, stale_seconds=30)
    os.remove(url)
    again.acquire()
    os.remove(url)                              # removed by hand
    with pytest.raises(RetryLater):
        again.check_held()
    again.release()


@pytest.mark.slow   # a moto S3 server
def test_on_s3_a_damaged_lease_is_dated_by_its_last_modified_and_fenced():
    from elmo_pipeline.output.lease import RetryLater
    from tests.pipeline_helpers import moto_s3
    with moto_s3("elmo-lease-unit") as (endpoint, fs):
        so = {"s3": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}}
        url = "s3://elmo-lease-unit/out/_lease.json"
        fs.pipe_file("elmo-lease-unit/out/_lease.json", b'{"heartbeat": "abc"}')
        with pytest.raises(LeaseHeld, match="without a usable heartbeat"):
            Lease(url, stale_seconds=3, storage_options=so).acquire()
        time.sleep(4.2)       # LastModified has whole seconds
        lease = Lease(url, stale_seconds=3, storage_options=so, heartbeat_seconds=60).acquire()
        lease.check_held()
        fs.pipe_file("elmo-lease-unit/out/_lease.json", json.dumps({"token": "other", "heartbeat": time.time()}).encode())
        with pytest.raises(RetryLater):
            lease.check_held()
        lease.release()
        fs.invalidate_cache()
        assert json.loads(fs.cat_file("elmo-lease-unit/out/_lease.json"))["token"] == "other"


def test_a_fifo_or_device_at_the_lease_is_no_lease_and_never_blocks(tmp_path):
    """read_lease of a FIFO or of a link to /dev/zero: no lease (NOT_JSON: it goes stale), read without blocking or
    allocating."""
    import fsspec

    from elmo_pipeline.output.lease import NOT_JSON, read_lease
    fs = fsspec.filesystem("file")
    fifo, zero = str(tmp_path / "fifo.json"), str(tmp_path / "zero.json")
    os.mkfifo(fifo)
    os.symlink("/dev/zero", zero)
    for path in (fifo, zero):
        assert read_lease(fs, path, False).holder == NOT_JSON


def test_a_folder_locked_by_another_process_is_waited_on_a_while_never_for_good(tmp_path, monkeypatch):
    """output/lease.py _guard: `flock OUT run ...` (a cron idiom) or a stopped run holding the folder's flock makes
    acquire() raise LeaseHeld (75) after GUARD_WAIT_SECONDS instead of hanging; the lock is held by an open file
    description of this process (flock locks are per description), and a release while it is held leaves the lease
    in place."""
    import fcntl
    from elmo_pipeline.output import lease as lease_module
    monkeypatch.setattr(lease_module, "GUARD_WAIT_SECONDS", 0.5)
    url = str(tmp_path / "out" / "_lease.json")
    mine = Lease(url, stale_seconds=30).acquire()
    fd = os.open(tmp_path / "out", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld, match=r"is locked \(flock\) by another process for over 0 s"):
            Lease(url, stale_seconds=30).acquire()
        assert time.monotonic() - t0 < 5
        mine.release()
        assert os.path.exists(url)
    finally:
        os.close(fd)
    mine.release()
    assert not os.path.exists(url)
