"""The LSTM directions side by side (model/direction_threads.py) and one direction's resets (Resets.direction)."""
import pytest
import torch

from elmo_pipeline.model.direction_threads import run_side_by_side
from elmo_pipeline.model.packing import PackedBatch


def test_side_by_side_runs_each_call_in_its_own_thread_with_its_share_of_threads():
    """Results in order; with 2 torch threads each call has 1 in a helper thread of its own, under the caller's
    inference mode; the caller keeps its thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        import threading
        with torch.inference_mode():
            got = run_side_by_side([lambda k=k: (k, torch.get_num_threads(), threading.get_ident(),
                                                 torch.is_inference_mode_enabled()) for k in range(2)])
        assert [g[0] for g in got] == [0, 1] and [g[1] for g in got] == [1, 1]
        assert len({g[2] for g in got} | {threading.get_ident()}) == 3 and all(g[3] for g in got)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)                        # one thread: the calls run here, one after the other
        here = run_side_by_side([threading.get_ident, threading.get_ident])
        assert here == [threading.get_ident()] * 2
    finally:
        torch.set_num_threads(before)


def test_side_by_side_raises_a_calls_error_after_both_ended():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ended = []

    def fails():
        raise ValueError("direction 0")

    def slow():
        import time
        time.sleep(0.2)
        ended.append(True)

    try:
        with pytest.raises(ValueError, match="direction 0"):
            run_side_by_side([fails, slow])
        assert ended == [True]
    finally:
        torch.set_num_threads(before)


def test_one_directions_resets_are_its_pairs_of_both():
    """Resets.direction(g).at(t) holds the rows of the (direction, row) pairs of at(t) whose direction is g."""
    lengths = torch.tensor([7, 3, 2, 5, 2, 4, 6, 3])
    pb = PackedBatch(lengths, int(lengths.max()), torch.device("cpu"), lanes=True)
    resets = pb.resets
    assert resets.spans, "lanes with several sentences restart somewhere"
    for g in (0, 1):
        mine = resets.direction(g)
        for step in resets.spans:
            dirs, rows = resets.at(step)
            want = rows[dirs == g].tolist()
            assert (mine.at(step)[0].tolist() if step in mine else []) == want


@pytest.mark.slow
def test_a_forked_child_makes_its_own_helpers():
    """After a fork the child has none of the parent's helper threads: it makes its own and gets its results."""
    import os
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_side_by_side([lambda: 1, lambda: 2])             # the parent's helpers exist
        pid = os.fork()
        if pid == 0:                                         # the child: exit status 0 only if the calls ran
            ok = False
            try:
                ok = run_side_by_side([lambda: 1, lambda: 2]) == [1, 2]
            finally:
                os._exit(0 if ok else 1)
        import signal
        import time
        deadline = time.monotonic() + 60                     # a child left with the parent's helpers would hang
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's calls did not finish")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        torch.set_num_threads(before)
