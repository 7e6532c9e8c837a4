"""When a request the plan keeps off drafts anyway: the goodput controller's exploration clock.

A request at budget 0 drafts one level now and then so that its acceptance estimate is not
frozen: about one request in ``every`` steps across the batch (a large batch explores each
request less often), staggered by request id so that requests that started together do not all
explore in the same step. An exploration after which the request is still not worth drafting
doubles its interval, up to MAX_BACKOFF times the base, and drafting resets it. A new request
starts from the backoff explorations have reached across requests (a chat's requests are short:
each starting again at the base interval, explorations would never back off, and an
exploration's catch-up is the largest cost of a drafter kept off); a request that drafts
anywhere resets that too.

    clock = ExplorationClock(every=16)
    explored = clock.step(request_ids, depths)   # sets depth 1 where one is due; their indices
    clock.drafted(request_id)                    # an explored request's draft was verified
    clock.due_within(request_id, 32)             # will it explore in the next 32 steps?
    clock.forget(request_id)                     # the request ended
"""

from __future__ import annotations

import zlib

# an exploration that leaves a request still not worth drafting doubles its interval, up to
# this many times the base (a drafter that does not pay costs ~1/8 of the exploring it did)
MAX_BACKOFF = 8


class ExplorationClock:
    """Per-request idle counters and backoffs (see module docstring); ``every`` 0: never."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.idle: dict[str, int] = {}  # steps since a request last drafted
        self.backoff: dict[str, int] = {}  # a request's interval multiplier
        self.carried = 1  # the backoff a new request starts from
        self.batch = 1  # requests in the last step (explorations are per batch)
        self.exploring: set[str] = set()  # requests explored in the last step
        self.explore_drafted: set[str] = set()  # of which drafted (``drafted``)

    def _interval(self, batch: int) -> int:
        return self.every * max(1, batch)

    def _start(self, request_id: str, interval: int) -> int:
        """A new request's idle count: negative, staggered by its id."""
        return -(zlib.crc32(request_id.encode()) % max(interval, 1))

    def step(self, request_ids: list[str], depths: list[int]) -> list[int]:
        """One step's plan (``depths``, one per request, 0: kept off) -> the indices of the
        requests that explore now; their depth is set to 1 in place."""
        interval = self._interval(len(request_ids))
        self.batch = len(request_ids)
        explored_before, self.exploring = self.exploring, set()
        # only an exploration that drafted says something (a request without drafter state,
        # specdec.engine.drafting, gets no draft: that one backs nothing off)
        drafted_before, self.explore_drafted = self.explore_drafted, set()
        out = []
        for i, rid in enumerate(request_ids):
            if rid not in self.idle:
                self.idle[rid] = self._start(rid, interval)
            backoff = self.backoff.get(rid, self.carried)
            if depths[i] > 0:
                backoff = self.carried = 1
            elif rid in explored_before and rid in drafted_before:  # it did not make it pay
                backoff = min(2 * backoff, MAX_BACKOFF)
                self.carried = max(self.carried, backoff)
            self.backoff[rid] = backoff
            idle = self.idle[rid] + 1 if depths[i] == 0 else 0
            if self.every and idle >= interval * backoff:
                depths[i], idle = 1, 0
                self.exploring.add(rid)
                out.append(i)
            self.idle[rid] = idle
        return out

    def drafted(self, request_id: str) -> None:
        """A draft of ``request_id`` was verified this step (an exploration's counts)."""
        if request_id in self.exploring:
            self.explore_drafted.add(request_id)

    def due_within(self, request_id: str, steps: int) -> bool:
        """Whether ``step`` would explore this request in the next ``steps`` steps while the plan
        keeps it off (at the batch size it last saw; an exploration that just drafted backs off
        first)."""
        if not self.every:
            return False
        interval = self._interval(self.batch)
        idle = self.idle.get(request_id, self._start(request_id, interval))
        backoff = self.backoff.get(request_id, self.carried)
        if request_id in self.exploring and request_id in self.explore_drafted:
            backoff = min(2 * backoff, MAX_BACKOFF)
        return interval * backoff - idle <= steps

    def forget(self, request_id: str) -> None:
        self.idle.pop(request_id, None)
        self.backoff.pop(request_id, None)
        self.exploring.discard(request_id)
