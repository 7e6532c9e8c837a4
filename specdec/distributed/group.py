"""One tensor-parallel group on torch.distributed: its ranks, its device, and the few collectives
tensor parallelism needs, each failing with a clear error within the group's timeout.

``TPGroup`` wraps one torch.distributed process group (the world of this process's default
group: TP size = world size). It is created either from explicit values (rank, world size, a
``tcp://host:port`` address or a ``torch.distributed.Store``, backend, timeout) or, under
``torchrun``, from its ``env://`` variables (``TPGroup.from_env()``). Tensors travel on the
group's backend (NCCL on CUDA, gloo on CPUs); pickled control messages (``broadcast_object``,
``all_gather_object``, ``barrier``) always travel on gloo: the same group under gloo, a gloo
group of the same ranks beside it under NCCL.

The exact all-reduce (``all_reduce(t)``, the default) is an all-gather of every rank's partial
sums and a sum in fixed rank order, ``((p0 + p1) + p2) + ...``: elementwise, so an element's
result depends only on the N partial values of that element -- not on the other rows, not on
the message size -- and every rank computes the same bits. The library all-reduce
(``exact=False``, gloo's / NCCL's ring) reduces in an order that changes with the message size
at N >= 3 (tests/distributed/test_group.py shows it), so a row verified among K others would
not be the row decoded alone. The exact mode moves N x the message to every rank (the ring
2 (N - 1) / N x): the price of exactness.

Counters (``TPGroup.counters``): every collective this rank called, by name (``all_reduce``,
``all_gather``, ``broadcast_object``, ``all_gather_object``, ``barrier``): calls, the wall
seconds this rank spent in them (waiting for the others included) and the bytes of its tensor
(all_reduce / all_gather: this rank's input; the pickled objects are not measured: 0). Two
``perf_counter`` reads a call; an exact all_reduce's own all-gather is counted as the
all_reduce, not again as an all_gather. ``counts()`` copies them (subtract two copies for an
interval: ``Collective.minus``).

Every collective runs under the group's timeout (``timeout_s``, default
``DEFAULT_TIMEOUT_S`` = 60 s, passed to ``init_process_group``): a peer that died or stopped
taking part makes it raise ``CollectiveError`` (naming the operation, this rank and the
cause) instead of hanging. After a ``CollectiveError`` the group is broken: close it.

Example (two processes; ``specdec.distributed.launch`` starts the others)::

    group = TPGroup.init(rank, 2, init_method="tcp://127.0.0.1:29500", backend="gloo")
    total = group.all_reduce(partial)           # same bits on both ranks
    plan = group.broadcast_object(plan, src=0)  # rank 0's object on every rank
    group.close()
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # every collective's and the rendezvous's limit, unless given
HALF_TYPES = (torch.float16, torch.bfloat16)
# the dtypes gloo's all_gather takes as they are on every torch we know (others: as bytes)
GLOO_TYPES = (torch.float32, torch.float64, torch.uint8, torch.int8, torch.int32, torch.int64)
_STORE_PREFIX = "specdec_tp"  # keys of our groups in a store (tcp:// and store= agree on it)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CollectiveError(RuntimeError):
    """A collective (or the rendezvous) failed or ran past the group's timeout: a peer rank
    died, raised, or stopped taking part. The group is unusable afterwards."""


COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object", "all_gather_object", "barrier")


@dataclass
class Collective:
    """One collective's running totals on this rank: calls, wall seconds, tensor bytes."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def add(self, seconds: float, nbytes: int = 0) -> None:
        self.calls += 1
        self.seconds += seconds
        self.bytes += nbytes

    def minus(self, other: Collective) -> Collective:
        return Collective(self.calls - other.calls, self.seconds - other.seconds,
                          self.bytes - other.bytes)


class TPGroup:
    """One tensor-parallel group: ``rank``, ``world_size``, ``device``, ``backend``,
    ``timeout_s``; the collectives ``all_reduce``, ``all_gather``, ``broadcast_object``,
    ``all_gather_object``, ``barrier``; ``close()`` (also as a context manager).

    Build it with ``TPGroup.init`` or ``TPGroup.from_env``; it initialises this process's
    default torch.distributed group (one TP group per process) and destroys it on close.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str,
                 timeout_s: float, pg, control_pg) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self._pg = pg  # tensors
        self._control = control_pg  # pickled objects and barriers (gloo)
        self._closed = False
        # what this rank spent in each collective so far (see the module's "Counters")
        self.counters: dict[str, Collective] = {name: Collective() for name in COLLECTIVES}

    def counts(self) -> dict[str, Collective]:
        """A copy of the counters now (subtract an earlier copy for an interval)."""
        return {name: Collective(c.calls, c.seconds, c.bytes)
                for name, c in self.counters.items()}

    # ---------------------------------------------------------------- construction

    @classmethod
    def init(cls, rank: int, world_size: int, *, init_method: str | None = None,
             store: dist.Store | None = None, backend: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S,
             device: torch.device | str | None = None) -> TPGroup:
        """Join a group of ``world_size`` ranks as ``rank``.

        Exactly one of ``init_method`` and ``store``: ``init_method`` a ``tcp://host:port``
        address (rank 0 hosts the store there, the others connect to it) or any other
        torch.distributed init method (``env://``, ``file://``); ``store`` a store every rank
        reaches (e.g. ``launch.Workers.store`` on rank 0, its address on the others). The
        ``tcp://`` and ``store`` forms key their entries under the same prefix, so they mix.
        ``backend``: "gloo" or "nccl" (default: "nccl" when CUDA is available, else "gloo").
        ``device``: default ``cpu`` under gloo, ``cuda:LOCAL_RANK`` (or rank mod the GPU count)
        under NCCL. ``timeout_s`` bounds the rendezvous and every later collective.
        """
        if (init_method is None) == (store is None):
            raise ValueError("give exactly one of init_method= and store=")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size="
                             f"{world_size})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if dist.is_initialized():
            raise RuntimeError("this process already has a torch.distributed default group: "
                               "close the TPGroup (or destroy_process_group) first")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        device = _resolve_device(backend, rank, device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if init_method is not None and init_method.startswith("tcp://"):
            store = _tcp_store(init_method, rank, world_size, timeout)
            init_method = None
        kwargs: dict[str, Any] = dict(backend=backend, rank=rank, world_size=world_size,
                                      timeout=timeout)
        if store is not None:
            kwargs["store"] = dist.PrefixStore(_STORE_PREFIX, store)
        else:
            kwargs["init_method"] = init_method
        start = time.monotonic()
        # torch names a default group by a process-wide counter that only a destroyed default
        # group resets: after a rendezvous that failed (no default group made) the next group
        # here would be named "1" and wait for keys the other ranks (named "0") never write
        _reset_group_names()
        try:
            dist.init_process_group(**kwargs)
            pg = dist.group.WORLD
            control = pg if backend == "gloo" else dist.new_group(backend="gloo",
                                                                  timeout=timeout)
        except (RuntimeError, dist.DistError) as e:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise CollectiveError(
                f"rank {rank} of {world_size} could not join the {backend} group within "
                f"{time.monotonic() - start:.1f} s (timeout {timeout_s:g} s): "
                f"{_first_line(e)}") from e
        return cls(rank, world_size, device, backend, timeout_s, pg, control)

    @classmethod
    def from_env(cls, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | str | None = None) -> TPGroup:
        """Join the group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``; ``LOCAL_RANK`` picks the GPU under NCCL) through ``env://``."""
        missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
        if missing:
            raise RuntimeError(f"not started by torchrun: {', '.join(missing)} not set (the "
                               f"env:// variables: {', '.join(TORCHRUN_VARIABLES)})")
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                        init_method="env://", backend=backend, timeout_s=timeout_s,
                        device=device)

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, t: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """The sum over ranks of ``t`` (same shape, dtype and device on every rank); use the
        returned tensor (the library mode reduces ``t`` in place and returns it; the exact
        mode leaves ``t`` as it is).

        ``exact=True``: every rank's ``t`` is all-gathered, then summed elementwise in rank
        order, ``(((p0 + p1) + p2) + ...)``, so an element's result depends only on its N
        partial values and every rank gets the same bits. In which dtype:

        - float32 / float64 (and integer types): gathered as they are, summed in their own
          dtype: N - 1 roundings per element, in rank order.
        - float16 / bfloat16: gathered as their raw bits (each element's 16 bits, carried
          as two uint8: gloo lacks half-type collectives in places, pytorch #111131, and
          int16 is not a gloo type at all on torch 2.13 -- "Invalid scalar type"; the bits
          travel unchanged), each part converted exactly to float32, summed in float32 in
          rank order, and the float32 sum rounded once to the input dtype (round to nearest
          even).

        ``exact=False``: ``torch.distributed.all_reduce`` (SUM) of the backend (a ring: its
        addition order, hence a row's bits, may change with the message size at N >= 3).
        A half-type tensor gloo refuses is reduced in float32 and rounded back.
        """
        if self.world_size == 1:
            self._check_open("all_reduce")
            return t
        start = time.perf_counter()
        try:
            if not exact:
                return self._library_all_reduce(t)
            return self._exact_all_reduce(t)
        finally:
            self.counters["all_reduce"].add(time.perf_counter() - start,
                                            t.numel() * t.element_size())

    def _exact_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        half = t.dtype in HALF_TYPES
        if half:  # the raw bits, as bytes: gloo gathers neither half types nor int16 in places
            raw = self._gather(t.contiguous().reshape(-1).view(torch.uint8))
            parts = raw.view(t.dtype).reshape(self.world_size, *t.shape).float()
        else:
            parts = self._gather(t)
        out = parts[0].clone()
        for i in range(1, self.world_size):
            out += parts[i]
        return out.to(t.dtype) if half else out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked in rank order: [world_size, *t.shape] (the bits as they
        are: a data movement only). Under gloo a dtype it has no collectives for (int16,
        bool, ...) travels as its bytes."""
        start = time.perf_counter()
        try:
            return self._gather(t)
        finally:
            self.counters["all_gather"].add(time.perf_counter() - start,
                                            t.numel() * t.element_size())

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self.backend == "gloo" and t.dtype not in GLOO_TYPES:
            raw = self._gather(t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool
                               else t.to(torch.uint8))
            return (raw.view(t.dtype) if t.dtype != torch.bool else raw.bool()).reshape(
                self.world_size, *t.shape)
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype, device=t.device)
        self._run("all_gather", dist.all_gather, list(out.unbind(0)), t, group=self._pg)
        return out

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled, over gloo) on every rank; the others' ``obj`` is
        ignored. For control messages (a step's plan), not for large tensors."""
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", dist.broadcast_object_list, box, src=src,
                  group=self._control, counted=True)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled, over gloo), in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", dist.all_gather_object, out, obj, group=self._control,
                  counted=True)
        return out

    def barrier(self) -> None:
        """Wait until every rank is here (gloo's monitored barrier: on a timeout rank 0's error
        names the ranks that did not arrive)."""
        if self.world_size == 1:
            self._check_open("barrier")
            return
        self._run("barrier", dist.monitored_barrier, group=self._control,
                  timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True,
                  counted=True)

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Destroy the group (and its gloo control group); idempotent."""
        if self._closed:
            return
        self._closed = True
        if not dist.is_initialized():
            return
        if self._control is not self._pg:
            dist.destroy_process_group(self._control)
        dist.destroy_process_group()
        # the last references: the process groups end now (their gloo threads joined), not
        # at the interpreter's exit, where a gloo thread releasing a finished collective's
        # tensor (it takes the GIL) is ended mid-unwind: std::terminate, SIGABRT
        self._pg = self._control = None
        gc.collect()  # (a cycle still holds them after destroy_process_group: ~0.15 s)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TPGroup(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, device={str(self.device)!r}, "
                f"timeout_s={self.timeout_s:g}{', closed' if self._closed else ''})")

    # ---------------------------------------------------------------- internals

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op} on a closed TPGroup (rank {self.rank})")

    def _run(self, op: str, fn, *args, counted: bool = False, **kwargs):
        """``fn(*args, **kwargs)``, a CollectiveError on failure; ``counted``: its call and
        seconds added to ``counters[op]`` (the tensor collectives count themselves)."""
        self._check_open(op)
        start = time.monotonic()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            raise CollectiveError(
                f"{op} failed on rank {self.rank} of {self.world_size} ({self.backend}) after "
                f"{time.monotonic() - start:.1f} s (timeout {self.timeout_s:g} s): "
                f"{_first_line(e)} (a peer rank that died, raised or stopped taking part "
                f"shows this way); the group is unusable now, close it") from e
        finally:
            if counted:
                self.counters[op].add(time.perf_counter() - t0)

    def _library_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self._run("all_reduce", dist.all_reduce, t, group=self._pg)
            return t
        except CollectiveError as e:
            if not (self.backend == "gloo" and t.dtype in HALF_TYPES
                    and "type" in str(e.__cause__).lower()):
                raise
        wide = t.float()  # an older gloo without half types: reduce in float32
        self._run("all_reduce", dist.all_reduce, wide, group=self._pg)
        t.copy_(wide)
        return t


def _reset_group_names() -> None:
    """The counter torch names unnamed groups by, back to 0 (as ``destroy_process_group``
    leaves it) when this process has no default group: every rank's default group is "0"."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def _resolve_device(backend: str, rank: int, device) -> torch.device:
    if device is not None:
        device = torch.device(device)
    elif backend == "gloo":
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        device = torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _tcp_store(address: str, rank: int, world_size: int,
               timeout: datetime.timedelta) -> dist.TCPStore:
    url = urlparse(address)
    if not url.hostname or not url.port:
        raise ValueError(f"init_method {address!r} is not tcp://HOST:PORT")
    try:
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                             timeout=timeout, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(f"rank {rank} of {world_size} could not "
                              f"{'host' if rank == 0 else 'reach'} the store at {address} "
                              f"within {timeout.total_seconds():g} s: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
