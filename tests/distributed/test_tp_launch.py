"""The worker processes of one machine: a worker that raises or is killed ends rank 0 with an
error naming the rank and the cause within 30 s; a rank that stops taking part makes rank 0's
collective fail within the group's timeout; no process is left after any of it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import tp_workers

from specdec.distributed import CollectiveError, WorkerError, launch

pytestmark = pytest.mark.xdist_group("distributed_spawn")  # spawning tests: one at a time

BOUND_S = 30.0  # the bound on a failure's error


@pytest.fixture(autouse=True)
def no_child_left():
    yield
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()


def test_a_worker_that_raises_is_named_with_its_cause():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        with launch(tp_workers.join_then_raise, 3, args=(20.0,), timeout_s=20.0) as workers:
            with workers.group() as group:
                group.all_reduce(torch.ones(3))  # rank 1 raises instead of taking part
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < BOUND_S
    assert err.rank == 1 and err.cause == "ValueError: bad shard 7 on purpose"
    assert err.exitcode == 1
    assert "worker rank 1 of 3 failed: ValueError: bad shard 7 on purpose" in str(err)
    assert "tp_workers.py" in err.traceback and "join_then_raise" in err.traceback
    assert isinstance(err.__cause__, CollectiveError)  # rank 0's own error, chained


def test_a_killed_worker_is_named_with_its_signal():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        with launch(tp_workers.join_then_idle, 3, args=(20.0,), timeout_s=20.0) as workers:
            with workers.group() as group:
                os.kill(workers.processes[1].pid, signal.SIGKILL)
                # ranks 0 and 2 wait for rank 1 in a collective: both fail, rank 2 reports a
                # CollectiveError of its own, rank 1's death is the cause named
                group.all_reduce(torch.ones(3))
    assert time.monotonic() - start < BOUND_S
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL
    assert err.cause == "killed by signal SIGKILL (exit code -9)"


def test_a_worker_killed_between_collectives_shows_in_check_and_join():
    with launch(tp_workers.kill_self, 2, timeout_s=20.0) as workers:
        with pytest.raises(WorkerError, match="rank 1 of 2 failed: killed by signal SIGKILL"):
            workers.join(timeout_s=BOUND_S)
        assert not workers.processes[1].is_alive()


def test_a_rank_that_stops_taking_part_fails_the_collective_within_the_timeout():
    with launch(tp_workers.join_then_idle, 2, args=(20.0,), timeout_s=2.0) as workers:
        with workers.group() as group:
            start = time.monotonic()
            with pytest.raises(CollectiveError) as info:
                group.all_reduce(torch.ones(3))
            elapsed = time.monotonic() - start
    assert 1.5 < elapsed < 10.0
    message = str(info.value)
    assert "all_gather failed on rank 0 of 2 (gloo)" in message and "timeout 2 s" in message


def test_an_exception_on_rank_0_ends_the_workers():
    start = time.monotonic()
    with pytest.raises(KeyError, match="on rank 0"):
        with launch(tp_workers.idle, 3, timeout_s=20.0) as workers:
            assert all(p.is_alive() for p in workers.processes.values())
            raise KeyError("on rank 0")
    assert time.monotonic() - start < 15.0
    assert all(p.exitcode == -signal.SIGTERM for p in workers.processes.values())


def test_close_ends_every_worker_and_is_idempotent():
    workers = launch(tp_workers.idle, 3, timeout_s=20.0)
    assert len(multiprocessing.active_children()) == 2
    workers.close()
    workers.close()
    assert multiprocessing.active_children() == []
    assert all(not p.is_alive() for p in workers.processes.values())


def test_join_names_the_ranks_still_running_after_its_limit():
    with launch(tp_workers.idle, 2, timeout_s=20.0) as workers:
        with pytest.raises(TimeoutError, match=r"worker ranks \[1\] of 2 still running"):
            workers.join(timeout_s=0.5)


def test_a_worker_that_raises_before_joining_is_named_after_the_rendezvous_timeout():
    """Rank 0's rendezvous waits for every rank until the group's timeout (here 3 s), then
    names the worker that never came and why."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 failed: RuntimeError: no weights"):
        with launch(tp_workers.raise_before_joining, 2, timeout_s=3.0) as workers:
            workers.group()
    assert time.monotonic() - start < 3.0 + BOUND_S


def test_a_worker_that_dies_while_starting_is_named_at_once():
    """Before the rendezvous rank 0 watches the workers until each says it runs: one that died
    while starting is a WorkerError at once, not after the group's timeout (here 20 s)."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 of 2 failed: exited with code 1"):
        with launch(tp_workers.idle, 2, args=(tp_workers.FailsToLoad(),),
                    timeout_s=20.0) as workers:
            workers.group()
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children()
