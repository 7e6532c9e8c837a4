"""The engine across ranks: one control plane on rank 0, the same forwards everywhere.

Rank 0 runs the whole engine (scheduler, KV page allocator, controller, drafters, verifier)
over its shard of the target (``TensorParallel``, here); ranks 1..N-1 hold theirs and run
``specdec.engine.tp_worker.serve``: a loop that takes
rank 0's messages (pickled through the group's gloo control channel) and does what rank 0's
target does to its own shard:

    ("allocate", num_pages)          the KV pages (the same count on every rank: rank 0's)
    ("forward", batch, layers)       the step's forward (ForwardBatch: ids, positions, block
                                     tables, tree masks; no logits: rank 0 makes them)
    ("cache", method, args)          a KV data move outside a forward (the accepted nodes'
                                     slots moved after a verification, pages copied on write)
    ("close",)                       leave the loop

Inside a forward every rank meets the others at each layer's two row-parallel reductions (o and
down: ``TPGroup.all_reduce``), so every rank's hidden states are the same bits; rank 0 takes the
logits of the rows it asked for. The reductions run in ``EngineConfig.tensor_parallel_reduce``'s
mode on every rank: "exact" (the default: an all-gather and a sum in rank order, a row's bits
independent of the other rows: speculation is plain decoding token for token) or "library"
(the backend's ring all-reduce: less data moved, but at N >= 3 a row's bits change with the
message size, so a verified row may part from the row decoded alone at a near-tie; the bench
reports how often, against plain decoding at the same N).

Counting (``TensorParallel.counts``, per step in ``StepStats.tp_*``, per step kind in the
bench's step budget): the reductions rank 0 took part in (calls, seconds on rank 0, bytes of
its partial sums) and the control messages it sent (``send``: the store's key and the
broadcast, its seconds). Drafters and their runners run on rank 0 only
(the learned heads read rank 0's hidden states, which are the full ones).

On one machine rank 0 starts the others (``TensorParallel.start``: torch.multiprocessing, spawn;
``specdec.distributed.launch``). Under torchrun (``WORLD_SIZE`` > 1 in the environment) every
process is started already: rank 0 runs the command, the others ``serve`` from
``python -m specdec`` (``specdec.engine.tp_worker.worker_from_env``).

Example::

    llm = LLM(model="tiny", tensor_parallel_size=2)   # rank 1 started here, serving
    llm.generate(["Hello"])                           # each forward: on both ranks
    llm.close()                                       # rank 1 ends; no process left
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from specdec.distributed.group import Collective, CollectiveError, TPGroup
from specdec.distributed.launch import FAILURE_WAIT_S, Workers, launch
from specdec.distributed.sharding import TPPlan, block_size, plan_tensor_parallel

logger = logging.getLogger("specdec")


def under_torchrun() -> bool:
    """This process was started by torchrun for a group of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


class TensorParallel:
    """Rank 0's side of a tensor-parallel engine: its group, the workers it started (None
    under torchrun) and the mirror of its target's forwards and KV moves onto the others."""

    def __init__(self, group: TPGroup, plan: TPPlan, workers: Workers | None,
                 exact: bool = True) -> None:
        self.group = group
        self.plan = plan
        self.workers = workers
        self.exact = exact  # the reductions' mode: exact (True) or the library's (False)
        self.closed = False
        self.threads_before: int | None = None  # rank 0's torch threads before start
        self.messages = 0  # sent so far (a forward, a KV move: each one broadcast)
        self.message_seconds = 0.0  # spent in send (the store's key and the broadcast)

    @property
    def reduce_mode(self) -> str:
        return "exact" if self.exact else "library"

    def counts(self) -> dict[str, Collective]:
        """Rank 0's totals so far: "reductions" (the layers' all-reduces: calls, seconds,
        bytes of rank 0's partial sums) and "messages" (control messages sent: count,
        seconds); subtract an earlier copy for an interval."""
        c = self.group.counters["all_reduce"]
        return {"reductions": Collective(c.calls, c.seconds, c.bytes),
                "messages": Collective(self.messages, self.message_seconds, 0)}

    @property
    def size(self) -> int:
        return self.group.world_size

    @classmethod
    def start(cls, config, plan: TPPlan, worker, args: tuple = ()) -> TensorParallel:
        """Rank 0 of ``config.tensor_parallel_size`` ranks: the others started here (spawned,
        one share of the cores each, running ``worker(rank, world_size, address, *args)``) or,
        under torchrun, joined through ``env://``."""
        n = config.tensor_parallel_size
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != n:
                raise ValueError(f"tensor_parallel_size={n} but torchrun started {world} "
                                 "processes (WORLD_SIZE): give the same number")
            if int(os.environ["RANK"]) != 0:
                raise RuntimeError("only rank 0 builds the engine; the other ranks serve "
                                   "(worker_from_env)")
            return cls(TPGroup.from_env(backend=backend(config)), plan, None,
                       exact=is_exact(config))
        threads = max(1, torch.get_num_threads() // n)
        workers = launch(worker, n, args=args, threads_per_rank=threads)
        try:
            group = workers.group(backend=backend(config))
        except BaseException:
            workers.close()
            raise
        tp = cls(group, plan, workers, exact=is_exact(config))
        tp.threads_before = torch.get_num_threads()  # given back on close
        torch.set_num_threads(threads)  # rank 0 its share too
        return tp

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The row-parallel layers' reduction (o, down): the group's, in the engine's mode
        (``tensor_parallel_reduce``: exact by default)."""
        try:
            return self.group.all_reduce(t, exact=self.exact)
        except CollectiveError as e:
            self._raise_cause(e)

    def _raise_cause(self, error: CollectiveError):
        """A collective failed: a worker raised or died. Raise what the worker said (its rank
        and cause: ``WorkerError``), waiting for it at most ``FAILURE_WAIT_S``; under torchrun
        (no handle on the others) rank 0's own error."""
        failure = None if self.workers is None else self.workers.wait_failure(FAILURE_WAIT_S)
        if failure is not None:
            raise failure from error
        raise error

    def send(self, message: tuple) -> None:
        """``message`` to every worker: its number set in the group's store (a worker idle for
        longer than the group's timeout waits there, not in a collective that would time out),
        then the message itself broadcast."""
        start = time.perf_counter()
        store = _store()
        store.set(_key(self.messages), b"1")
        if self.messages >= STORE_LAG:  # every worker has read it (see STORE_LAG)
            store.delete_key(_key(self.messages - STORE_LAG))
        self.messages += 1
        try:
            self.group.broadcast_object(message)
        except CollectiveError as e:
            self._raise_cause(e)
        finally:
            self.message_seconds += time.perf_counter() - start

    def allocate(self, num_pages: int) -> None:
        """Every worker allocates the same KV pages as rank 0; an error on any names it."""
        self.send(("allocate", num_pages))
        try:
            answers = self.group.all_gather_object(None)
        except CollectiveError as e:
            self._raise_cause(e)
        bad = [(r, a) for r, a in enumerate(answers) if r and a is not None]
        if bad:
            raise RuntimeError("; ".join(f"rank {r}: {a}" for r, a in bad))

    def mirror(self, runner) -> None:
        """From now on the target runner's forwards and KV moves run on every rank: each
        forward first sends its batch (no logits rows: rank 0 makes the logits), each KV move
        its arguments (the runner's ``before_forward`` and its cache's ``on_move`` hooks)."""
        def forward_everywhere(batch) -> None:
            self.send(("forward", dataclasses.replace(
                batch, logits_indices=batch.logits_indices[:0]), ()))

        def move_everywhere(name: str, args: tuple) -> None:
            self.send(("cache", name, args))

        runner.before_forward = forward_everywhere
        runner.kv.cache.on_move = move_everywhere

    def close(self) -> None:
        """The workers leave their loop and end; the group closes. Twice is fine."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.group.closed:
                self.send(("close",))
        except Exception as e:  # a worker already gone: closing anyway
            logger.warning("tensor parallel: closing after %r", e)
        finally:
            try:
                if self.workers is not None:
                    self.workers.join(timeout_s=30)
            except Exception as e:
                logger.warning("tensor parallel: workers did not end cleanly: %r", e)
            finally:
                self.group.close()
                if self.workers is not None:
                    self.workers.close()
                if self.threads_before is not None:  # the process's threads as they were
                    torch.set_num_threads(self.threads_before)


# a worker is never more than a few messages behind rank 0 (every forward meets all ranks in
# its reductions): the store key of a message this many back is read by all and deleted
STORE_LAG = 64
IDLE_POLL_S = 5.0  # a waiting worker's store wait, repeated while rank 0 is idle


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _key(n: int) -> str:
    return f"specdec_tp_message/{n}"


def next_message(group: TPGroup, n: int):
    """Message ``n`` from rank 0: wait for its number in the store as long as rank 0 is idle
    (a dead rank 0 ends this process: launch's watch, or the store's connection), then take
    part in its broadcast."""
    import datetime

    store = _store()
    while True:
        try:
            store.wait([_key(n)], datetime.timedelta(seconds=IDLE_POLL_S))
            break
        except Exception as e:  # the wait's timeout: rank 0 idle; anything else: gone
            if "timeout" not in str(e).lower() and "wait timeout" not in str(e).lower():
                raise
    return group.broadcast_object(None)


def is_exact(config) -> bool:
    """Whether the engine's reductions are the exact ones (``tensor_parallel_reduce``)."""
    return getattr(config, "tensor_parallel_reduce", "exact") == "exact"


def reducer(group: TPGroup, config):
    """A worker's reduction for ``shard_decoder``: the group's all-reduce in the engine's mode
    (every rank must reduce the same way: rank 0's ``TensorParallel.reduce``)."""
    exact = is_exact(config)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(t, exact=exact)

    return reduce


def backend(config) -> str:
    """The group's backend for the engine's device: NCCL on CUDA, gloo on CPUs."""
    return "nccl" if torch.device(config.device).type == "cuda" else "gloo"


def check_plan(config, model_config, folder) -> TPPlan:
    """The TP plan of the model in ``folder``, or the ValueError naming what stands in the way
    (before any process starts): a GGUF computed on its own blocks cuts o and down at their
    blocks' boundaries."""
    blocks = None if config.weights == "dequantized" else gguf_row_parallel_blocks(folder)
    return plan_tensor_parallel(model_config, config.tensor_parallel_size, blocks)


def gguf_row_parallel_blocks(folder) -> dict[str, int] | None:
    """The largest block size of the folder's GGUF o and down matrices over its layers (an
    MoE's: its experts' and shared expert's down; None: not a GGUF's folder)."""
    from specdec.models.gguf.file import open_gguf
    from specdec.models.loader import gguf_source

    path = gguf_source(folder)
    if path is None:
        return None
    tensors = open_gguf(path).tensors
    out = {}
    for matrix, suffix in (("o_proj", "attn_output.weight"), ("down_proj", "ffn_down.weight"),
                           ("experts.down_proj", "ffn_down_exps.weight"),
                           ("shared_expert.down_proj", "ffn_down_shexp.weight")):
        sizes = [block_size(t.kind) for name, t in tensors.items() if name.endswith(suffix)]
        if sizes and max(sizes) > 1:
            out[matrix] = max(sizes)
    return out


def shard_config(config):
    """What a worker rank needs of the engine's options: the target's (no drafter, controller
    or second KV tier: those live on rank 0), picklable for spawn."""
    return dataclasses.replace(config, drafter=None, drafter_args={}, controller=None,
                               controller_args={}, kv_tier_path=None, kv_host_tier_bytes=None)
