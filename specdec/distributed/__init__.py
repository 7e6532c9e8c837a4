"""Tensor parallelism's foundation on torch.distributed (issue #54): one TP group and its exact
collectives (``group``), the worker processes of one machine (``launch``), and the split of a
model over N ranks, checked before any process starts (``sharding``). Not wired into the
engine yet.

    from specdec.distributed import TPGroup, launch, plan_tensor_parallel
"""

from specdec.distributed.group import DEFAULT_TIMEOUT_S, CollectiveError, TPGroup
from specdec.distributed.launch import WorkerError, Workers, launch
from specdec.distributed.sharding import (
    RankShard,
    TPPlan,
    block_size,
    check_row_parallel_split,
    plan_tensor_parallel,
    tp_sizes_that_work,
)

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveError", "RankShard", "TPGroup", "TPPlan",
           "WorkerError", "Workers", "block_size", "check_row_parallel_split", "launch",
           "plan_tensor_parallel", "tp_sizes_that_work"]
