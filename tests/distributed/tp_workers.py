"""Bodies the tests run on every rank (rank 0 in the test's process, the others in spawned
workers: module-level, so that spawn can pickle them by name).

``collective_checks(group)`` runs the same collectives on every rank and asserts what must hold
on each; it returns rank 0's findings (the library ring's size dependence, ...) for the test to
assert on. A worker's failed assertion reaches the test as a WorkerError naming its rank.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from specdec.distributed import TPGroup

HIDDEN = 576  # SmolLM2-135M's hidden size: a row of an o / down all-reduce
OTHERS = 64  # the row alone, then among 1..64 other rows


def rank_data(rank: int, dtype=torch.float32) -> torch.Tensor:
    """Rank ``rank``'s partial sums: 1 + OTHERS rows of HIDDEN, reproducible on any rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(1 + OTHERS, HIDDEN, generator=g).to(dtype)


def fixed_order_sum(world_size: int, dtype=torch.float32) -> torch.Tensor:
    """The exact mode's promised result, computed locally: ((p0 + p1) + p2) + ... in the
    dtype (half types: in float32, rounded once)."""
    wide = dtype in (torch.float16, torch.bfloat16)
    parts = [rank_data(r, dtype) for r in range(world_size)]
    acc = parts[0].float() if wide else parts[0].clone()
    for p in parts[1:]:
        acc = acc + (p.float() if wide else p)
    return acc.to(dtype)


def messages():
    """(n, position, message builder): the target row (row 0) alone, then among n = 1..64
    others, at the front, the back and in the middle of the message."""
    for n in range(0, OTHERS + 1):
        for where in sorted({0, n, n // 2}):
            yield n, where


def build(data: torch.Tensor, n: int, where: int) -> torch.Tensor:
    others = data[1:1 + n]
    return torch.cat([others[:where], data[:1], others[where:]]).contiguous()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def row_sizes_that_differ(group: TPGroup, dtype, exact: bool) -> tuple[list, torch.Tensor]:
    """All-reduce the target row in every message; the (n, position) whose result for the row
    differs in any bit from the row reduced alone, and the row alone's result."""
    data = rank_data(group.rank, dtype)
    alone = None
    differ = []
    for n, where in messages():
        out = group.all_reduce(build(data, n, where), exact=exact)
        row = out[where].clone()
        if alone is None:
            alone = row
        elif not torch.equal(bits(row), bits(alone)):
            differ.append((n, where, int((bits(row) != bits(alone)).sum())))
    return differ, alone


def collective_checks(group: TPGroup) -> dict:
    torch.set_num_threads(1)
    ws, rank = group.world_size, group.rank
    report: dict = {"rank": rank}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        differ, alone = row_sizes_that_differ(group, dtype, exact=True)
        assert not differ, f"exact {dtype}: the row's bits changed with the message: {differ}"
        # the promised sum, bit for bit, and the same bits on every rank
        want = fixed_order_sum(ws, dtype)
        assert torch.equal(bits(alone), bits(want[0])), f"exact {dtype}: not the rank-order sum"
        full = group.all_reduce(rank_data(rank, dtype))
        assert full.dtype == dtype
        assert torch.equal(bits(full), bits(want)), f"exact {dtype}: not the rank-order sum"
        again = group.all_reduce(rank_data(rank, dtype))
        assert torch.equal(bits(again), bits(full)), f"exact {dtype}: not repeatable"
        everyone = group.all_gather(bits(full))
        assert all(torch.equal(everyone[r], bits(full)) for r in range(ws)), \
            f"exact {dtype}: ranks disagree"
        # the input is left as it was
        assert torch.equal(bits(rank_data(rank, dtype)), bits(rank_data(rank, dtype)))
    # the library ring: which messages change the row's bits (float32)
    ring_differ, ring_alone = row_sizes_that_differ(group, torch.float32, exact=False)
    report["ring_differ"] = ring_differ
    # the library result is still the same on every rank for one message
    everyone = group.all_gather(bits(ring_alone))
    report["ring_ranks_agree"] = all(torch.equal(everyone[r], everyone[0]) for r in range(ws))
    # library mode on a half type (gloo of this torch accepts it; an older one: float32 path)
    half = group.all_reduce(rank_data(rank, torch.bfloat16)[:4], exact=False)
    assert half.dtype == torch.bfloat16 and half.shape == (4, HIDDEN)
    # control messages
    plan = {"step": 7, "tokens": [1, 2, 3], "mask": torch.tensor([[True, False]])}
    got = group.broadcast_object(plan if rank == 0 else None, src=0)
    assert got["step"] == 7 and got["tokens"] == [1, 2, 3]
    assert torch.equal(got["mask"], plan["mask"])
    from_last = group.broadcast_object(f"hello from {rank}", src=ws - 1)
    assert from_last == f"hello from {ws - 1}"
    assert group.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(ws)]
    group.barrier()
    return report


def run_checks(rank: int, world_size: int, address: str, timeout_s: float) -> None:
    with TPGroup.init(rank, world_size, init_method=address, backend="gloo",
                      timeout_s=timeout_s) as group:
        collective_checks(group)


def join_then_raise(rank: int, world_size: int, address: str, timeout_s: float) -> None:
    """Joins the group, then raises (rank 1) while the others wait in a collective."""
    with TPGroup.init(rank, world_size, init_method=address, backend="gloo",
                      timeout_s=timeout_s) as group:
        if rank == 1:
            raise ValueError("bad shard 7 on purpose")
        group.all_reduce(torch.ones(3))


def join_then_idle(rank: int, world_size: int, address: str, timeout_s: float) -> None:
    """Joins the group and then takes part in nothing (a hung rank, or a killed one's body)."""
    with TPGroup.init(rank, world_size, init_method=address, backend="gloo",
                      timeout_s=timeout_s) as group:
        if rank == 2:
            group.all_reduce(torch.ones(3))  # rank 2 waits in a collective with rank 0
        time.sleep(120)


def idle(rank: int, world_size: int, address: str) -> None:
    """Never joins a group: waits to be ended."""
    time.sleep(120)


def kill_self(rank: int, world_size: int, address: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def raise_before_joining(rank: int, world_size: int, address: str) -> None:
    raise RuntimeError("no weights for this rank")


def _fail_to_load():
    raise RuntimeError("this argument cannot be loaded")


class FailsToLoad:
    """An argument whose unpickling raises: the spawned worker dies while starting, before its
    function runs (as a script without ``if __name__ == "__main__":`` does)."""

    def __reduce__(self):
        return (_fail_to_load, ())
