"""The TP group's collectives on gloo at 2 and 3 ranks (rank 0 here, the others spawned).

What they show:
- the exact all-reduce is the rank-order sum bit for bit, repeatable, the same on every rank,
  and a row's bits do not depend on the message (the row alone, or among 1..64 other rows at
  the front, middle or back), for float32 and, through their int16 bits, bfloat16 / float16;
- why it is needed: gloo's library (ring) all-reduce at 3 ranks gives the same row different
  bits in different messages (at 2 ranks it cannot: a + b = b + a);
- control messages: broadcast_object from any rank, all_gather_object, barrier.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import tp_workers

from specdec.distributed import TPGroup, launch

# every test here spawns ranks: one xdist worker runs them, one after the other
pytestmark = pytest.mark.xdist_group("distributed_spawn")

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def report(request):
    """rank 0's findings of tp_workers.collective_checks at 2 and 3 ranks (every rank's own
    assertions passed, or a WorkerError names the rank that failed)."""
    world_size = request.param
    with launch(tp_workers.run_checks, world_size, args=(TIMEOUT_S,), timeout_s=TIMEOUT_S,
                threads_per_rank=1) as workers:
        with workers.group(backend="gloo") as group:
            found = tp_workers.collective_checks(group)
        workers.join()
    assert not multiprocessing.active_children()
    return world_size, found


def test_exact_all_reduce_is_the_rank_order_sum_on_every_rank_whatever_the_message(report):
    """collective_checks asserts it on every rank (float32, bfloat16, float16): reaching here
    means every rank passed."""
    world_size, found = report
    assert found["rank"] == 0


def test_the_library_ring_changes_a_rows_bits_with_the_message_size_at_3_ranks(report):
    world_size, found = report
    assert found["ring_ranks_agree"]  # one message: every rank the same bits
    if world_size == 2:
        # two partial sums add in either order to the same bits: nothing to show at 2
        assert found["ring_differ"] == []
    else:
        # the ring's chunk boundaries move with the message size, so the row's addition
        # order does: e.g. the row alone vs the row with one other row after it
        assert found["ring_differ"], "gloo's ring gave every message the same bits here"
        sizes = {n for n, _, _ in found["ring_differ"]}
        assert 1 in sizes  # alone (576 floats) vs among one other (1152 floats)


def test_a_one_rank_group_returns_its_input():
    from specdec.distributed.launch import Workers

    with Workers(tp_workers.idle, 1, timeout_s=TIMEOUT_S) as workers:
        assert workers.processes == {}
        with workers.group() as group:
            t = torch.randn(3, 5)
            assert group.all_reduce(t) is t
            assert group.broadcast_object({"a": 1}) == {"a": 1}
            assert group.all_gather_object(5) == [5]
            group.barrier()
            assert (group.rank, group.world_size, group.device.type) == (0, 1, "cpu")
        assert group.closed
        with pytest.raises(RuntimeError, match="closed"):
            group.all_reduce(t)
    assert not torch.distributed.is_initialized()


def test_init_refuses_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        TPGroup.init(0, 2)
    with pytest.raises(ValueError, match="rank=2"):
        TPGroup.init(2, 2, init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="backend"):
        TPGroup.init(0, 1, init_method="tcp://127.0.0.1:1", backend="mpi")


def test_from_env_names_the_missing_torchrun_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        TPGroup.from_env()


def test_from_env_joins_a_one_rank_group(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    with TPGroup.from_env(backend="gloo", timeout_s=10) as group:
        assert (group.rank, group.world_size) == (0, 1)
        assert torch.equal(group.all_gather(torch.arange(3)), torch.arange(3)[None])
    assert not torch.distributed.is_initialized()
