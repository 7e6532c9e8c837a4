"""The body ``test_tp_counters`` runs on every rank (module-level, so that spawn can pickle it
by name): a known sequence of collectives, whose counts rank 0 returns."""

from __future__ import annotations

import torch

from specdec.distributed import TPGroup

ROWS, HIDDEN = 3, 8  # a float32 [3, 8] partial sum: 96 bytes


def collectives(group: TPGroup) -> dict:
    """3 exact and 2 library all-reduces, 1 all_gather, 2 broadcast_object, 1
    all_gather_object, 1 barrier; every rank checks its own counters and rank 0 returns them
    (with a copy taken halfway, to check that a copy does not move)."""
    torch.set_num_threads(1)
    t = torch.full((ROWS, HIDDEN), float(group.rank + 1))
    for _ in range(3):
        assert torch.equal(group.all_reduce(t), torch.full_like(t, 3.0))  # 1 + 2
    halfway = group.counts()
    for _ in range(2):
        group.all_reduce(t.clone(), exact=False)
    group.all_gather(t)
    group.broadcast_object({"step": 1} if group.rank == 0 else None)
    group.broadcast_object("again")
    group.all_gather_object(group.rank)
    group.barrier()
    c = group.counters
    assert c["all_reduce"].calls == 5 and c["all_reduce"].bytes == 5 * ROWS * HIDDEN * 4
    assert c["all_gather"].calls == 1  # the exact reductions' own gathers are not counted
    return {"counts": {k: (v.calls, v.seconds, v.bytes) for k, v in c.items()},
            "halfway": {k: (v.calls, v.seconds, v.bytes) for k, v in halfway.items()},
            "interval": group.counters["all_reduce"].minus(halfway["all_reduce"]).calls}


def run(rank: int, world_size: int, address: str, timeout_s: float) -> None:
    with TPGroup.init(rank, world_size, init_method=address, backend="gloo",
                      timeout_s=timeout_s) as group:
        collectives(group)
