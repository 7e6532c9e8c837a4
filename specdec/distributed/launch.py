"""Start the N - 1 worker ranks of a tensor-parallel group on this machine, watch them, and end
them: no worker outlives its handle, and a worker's failure becomes an error on rank 0 naming
the rank and the cause.

The caller is rank 0. ``launch(fn, N)`` hosts a store on a free localhost port (a
``torch.distributed.TCPStore`` bound to port 0: no race for the port) and starts ranks
1..N-1 as processes of torch.multiprocessing's ``spawn`` context, each running
``fn(rank, world_size, address, *args)`` with ``address`` = ``tcp://127.0.0.1:PORT``; a worker
joins the group with ``TPGroup.init(rank, world_size, init_method=address)``, rank 0 with
``workers.group()``. ``fn`` must be picklable (a module-level function).

Failure handling:

- a worker that raises sends its exception's type, message and traceback to rank 0 through a
  multiprocessing queue and exits with code 1; a worker that dies (a signal, ``os._exit``) is
  seen by its exit code (``Process.is_alive`` / ``exitcode``);
- rank 0 learns of it at its next collective (gloo sees the peer's connection close, or the
  group's timeout runs out: a ``CollectiveError``), in ``join()`` / ``check()``, or when
  leaving the ``with`` block on an exception: the handle then waits up to ``failure_wait_s``
  (default 30 s) for the failure to show and raises ``WorkerError`` naming the rank and the
  cause, chained to rank 0's own error;
- ``close()`` (and every error path) ends the others: SIGTERM, then SIGKILL after
  ``grace_s``; a worker whose parent (rank 0) dies exits by itself. After ``close()``
  ``multiprocessing.active_children()`` lists none of them.

Example::

    def worker(rank, world_size, address):
        with TPGroup.init(rank, world_size, init_method=address, backend="gloo") as group:
            group.all_reduce(torch.ones(4))

    with launch(worker, 3) as workers:
        with workers.group() as group:
            group.all_reduce(torch.ones(4))   # tensor([3., 3., 3., 3.])
        workers.join()
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from specdec.distributed.group import DEFAULT_TIMEOUT_S, CollectiveError, TPGroup

FAILURE_WAIT_S = 30.0  # how long rank 0 waits for a failing worker's cause to show
TRACEBACK_CHARS = 16_000  # a worker's traceback sent to rank 0 is cut to its last characters


class WorkerError(RuntimeError):
    """A worker rank raised or died. ``rank``, ``cause`` (e.g. "ValueError: bad shard" or
    "killed by signal SIGKILL"), ``exitcode`` (None while unknown) and ``traceback`` (the
    worker's, when it raised)."""

    def __init__(self, rank: int, world_size: int, cause: str, exitcode: int | None = None,
                 traceback: str = "") -> None:
        self.rank, self.world_size, self.cause = rank, world_size, cause
        self.exitcode, self.traceback = exitcode, traceback
        message = f"worker rank {rank} of {world_size} failed: {cause}"
        if traceback:
            message += f"\n\nrank {rank}'s traceback:\n{traceback.rstrip()}"
        super().__init__(message)


def _cause_of_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {name} (exit code {code})"
    return f"exited with code {code} without reporting an error (its stderr may say why)"


def _watch_parent() -> None:
    """In a worker: exit when the parent (rank 0) is gone, so no worker is orphaned."""
    from multiprocessing import connection, parent_process

    parent = parent_process()
    if parent is None:
        return

    def wait() -> None:
        connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="specdec-parent-watch", daemon=True).start()


def _worker_main(fn: Callable, rank: int, world_size: int, address: str, args: tuple,
                 errors, threads: int | None) -> None:
    """A worker's body: run fn; on an exception report (rank, cause, traceback) and exit 1."""
    _watch_parent()
    _say_started(address, rank)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        fn(rank, world_size, address, *args)
    except BaseException as e:  # noqa: BLE001 -- every failure is reported to rank 0
        if isinstance(e, SystemExit) and e.code in (None, 0):
            return
        text = traceback.format_exc()[-TRACEBACK_CHARS:]
        collective = isinstance(e, (CollectiveError, dist.DistError))
        errors.put((rank, f"{type(e).__name__}: {e}".splitlines()[0], text, collective))
        errors.close()
        errors.join_thread()  # the report is in the pipe before this process exits
        os._exit(1)


def _started_key(rank: int) -> str:
    return f"specdec_tp_started/{rank}"


def _say_started(address: str, rank: int) -> None:
    """Tell rank 0 (its store) that this worker runs: until every worker has, rank 0 watches
    them instead of waiting in the group's rendezvous (a worker that dies while starting, e.g.
    a script without ``if __name__ == "__main__":``, is then named at once)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    store.set(_started_key(rank), "1")


class Workers:
    """The handle of ranks 1..N-1 started by ``launch``: ``address``, ``store`` (rank 0's),
    ``processes``; ``group()``, ``check()``, ``join()``, ``wait_failure()``, ``close()``; a
    context manager (``close`` on exit; a worker's failure raised as ``WorkerError``)."""

    def __init__(self, fn: Callable, world_size: int, *, args: tuple = (),
                 timeout_s: float = DEFAULT_TIMEOUT_S, failure_wait_s: float = FAILURE_WAIT_S,
                 threads_per_rank: int | None = None, grace_s: float = 3.0,
                 host: str = "127.0.0.1") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.failure_wait_s = failure_wait_s
        self.grace_s = grace_s
        self.store = dist.TCPStore(host, 0, world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.address = f"tcp://{host}:{self.store.port}"
        self._group: TPGroup | None = None
        self._failures: list[tuple[int, str, str, bool]] = []
        self._closed = False
        ctx = torch_mp.get_context("spawn")
        self._errors = ctx.Queue()
        self.processes: dict[int, Any] = {}
        try:
            for rank in range(1, world_size):
                p = ctx.Process(target=_worker_main, name=f"specdec-tp-rank{rank}",
                                args=(fn, rank, world_size, self.address, tuple(args),
                                      self._errors, threads_per_rank), daemon=True)
                p.start()
                self.processes[rank] = p
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- rank 0's group

    def group(self, *, backend: str = "gloo", device=None) -> TPGroup:
        """Rank 0's TPGroup (this process), on the handle's store and timeout; closed by
        ``close()`` if not before."""
        if self._group is not None and not self._group.closed:
            raise RuntimeError("rank 0's group is already open")
        self._wait_started()
        self._group = TPGroup.init(0, self.world_size, store=self.store, backend=backend,
                                   timeout_s=self.timeout_s, device=device)
        return self._group

    def _wait_started(self) -> None:
        """Until every worker runs (``_say_started``), watch them: one that failed or died
        while starting is a WorkerError now, not the rendezvous's timeout later."""
        keys = [_started_key(r) for r in self.processes]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            failure = self.poll()
            if failure is not None:
                self.close()
                raise failure
            if time.monotonic() >= deadline:
                self.close()
                raise TimeoutError(f"tensor parallel: the {self.world_size - 1} worker(s) did "
                                   f"not start within {self.timeout_s:g} s")
            time.sleep(0.02)

    # ---------------------------------------------------------------- failures

    def poll(self) -> WorkerError | None:
        """The failure seen so far (non-blocking), or None: a worker's own exception first,
        then a worker that died without reporting, then a collective error a worker reported
        (the consequence of another rank's failure)."""
        self._drain()
        own = [f for f in self._failures if not f[3]]
        if own:
            return self._error(own[0])
        for rank, p in self.processes.items():
            if not p.is_alive() and p.exitcode not in (0, None) and not any(
                    f[0] == rank for f in self._failures):
                return WorkerError(rank, self.world_size, _cause_of_exit(p.exitcode), p.exitcode)
        return self._error(self._failures[0]) if self._failures else None

    def wait_failure(self, timeout_s: float) -> WorkerError | None:
        """Wait up to ``timeout_s`` for a worker's failure to show; then a short moment more
        for its reports to arrive (the root cause over its consequences). None if none did."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.poll()
            if found is not None:
                time.sleep(0.2)
                return self.poll()
            if time.monotonic() >= deadline or not any(
                    p.is_alive() for p in self.processes.values()):
                return self.poll()
            time.sleep(0.05)

    def check(self) -> None:
        """Raise ``WorkerError`` (after ending every worker) if a worker has failed."""
        failure = self.poll()
        if failure is not None:
            self.close()
            raise failure

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for every worker to finish (default limit: the handle's ``timeout_s``);
        ``WorkerError`` as soon as one fails, TimeoutError naming the ranks still running.
        Both end the workers first."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while any(p.is_alive() for p in self.processes.values()):
            self.check()
            if time.monotonic() >= deadline:
                running = [r for r, p in self.processes.items() if p.is_alive()]
                self.close()
                raise TimeoutError(f"worker ranks {running} of {self.world_size} still running "
                                   f"after {limit:g} s")
            time.sleep(0.05)
        for p in self.processes.values():
            p.join()
        self.check()

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """End rank 0's group and every worker (SIGTERM, SIGKILL after ``grace_s``), reap
        them, and release the queue and the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.close()
        self._drain()
        alive = [p for p in self.processes.values() if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes.values():
            if p.is_alive():
                p.kill()
            p.join()
        self._drain()
        self._errors.close()
        self._errors.join_thread()
        self.store = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; on rank 0's exception, raise the worker failure behind it (waiting up to
        ``failure_wait_s`` when the exception is a CollectiveError); on a clean exit, raise a
        worker failure seen by then. Workers still running are ended: ``join()`` inside the
        block to wait for them."""
        try:
            if self._closed or isinstance(exc, WorkerError):
                return
            if exc is None:
                failure = self.poll()
                if failure is not None:
                    raise failure
                return
            wait = self.failure_wait_s if isinstance(exc, CollectiveError) else 0.0
            failure = self.wait_failure(wait)
            if failure is not None:
                raise failure from exc
        finally:
            self.close()

    def _drain(self) -> None:
        while True:
            try:
                self._failures.append(self._errors.get_nowait())
            except (queue_module.Empty, OSError, ValueError):
                return

    def _error(self, failure: tuple[int, str, str, bool]) -> WorkerError:
        rank, cause, text, _ = failure
        p = self.processes.get(rank)
        return WorkerError(rank, self.world_size, cause, p.exitcode if p else None, text)


def launch(fn: Callable, world_size: int, *, args: tuple = (),
           timeout_s: float = DEFAULT_TIMEOUT_S, failure_wait_s: float = FAILURE_WAIT_S,
           threads_per_rank: int | None = None) -> Workers:
    """Start ranks 1..world_size-1 running ``fn(rank, world_size, address, *args)`` in
    spawned processes; the caller is rank 0 (``Workers.group()``). ``timeout_s``: the group's
    (rank 0's and, by convention, the workers'); ``threads_per_rank``: torch threads set in
    each worker before ``fn``. Use the handle as a context manager or ``close()`` it."""
    return Workers(fn, world_size, args=args, timeout_s=timeout_s,
                   failure_wait_s=failure_wait_s, threads_per_rank=threads_per_rank)
