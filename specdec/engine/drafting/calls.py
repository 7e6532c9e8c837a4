"""A drafter call for many requests whose failure stays with the requests it concerns.

``isolate(call, items, check, replay_safe, raised)`` runs ``call(items)`` once; when it raises
(or ``check`` rejects what it returned) a ``replay_safe`` drafter is asked again request by
request, so only the requests that fail alone get an error, and any other gets ``Unblamed`` for
every request of the call (it must not be called twice in a step: drafters/base.py,
"Failures"). Whatever the outcome, every exception is kept in ``raised`` as (how many requests
the call had, the exception): a batched call that raised though each request alone succeeded
is a bug the outputs do not show. Used by the drafter stage (drafter_stage.py) for propose and
on_verified.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.drafters.base import VerifiedBatch


def check_trees(out, n: int) -> str | None:
    """What is wrong with propose's result for ``n`` requests, in words, or None:
    ``"returned a list of 2 trees, expected one tree (one per request)"``."""
    if isinstance(out, list) and len(out) == n:
        return None
    got = _trees(len(out), "a list of ") if isinstance(out, list) else \
        f"{type(out).__name__}, not a list"
    return f"returned {got}, expected {_trees(n)} (one per request)"


def _trees(n: int, prefix: str = "") -> str:
    return "one tree" if n == 1 and not prefix else f"{prefix}{n} tree{'' if n == 1 else 's'}"


class Unblamed:
    """The outcome for a request of a call that raised for several requests, which a drafter
    that is not replay_safe cannot be asked about again."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def isolate(call: Callable, items, check: Callable, replay_safe: bool,
            raised: list[tuple[int, Exception]]) -> list:
    """call(items) -> per item its result, an error string (the item fails: the drafter marked
    it with ``fail``, or its own call raised) or ``Unblamed``. When the call raises (or
    ``check(out, n)`` rejects its output), it is retried item by item only if ``replay_safe``.
    ``items`` is a list of DraftRequest or a VerifiedBatch (whose calls return None); each
    exception caught is appended to ``raised`` with the number of items of its call."""
    reqs = items.requests if isinstance(items, VerifiedBatch) else items
    n = len(reqs)
    try:
        out = call(items)
        problem = check(out, n)
    except Exception as e:
        problem = f"failed: {e!r}"
        raised.append((n, e))
    if problem is None and all(r.error is None for r in reqs):  # (the usual call)
        return list(out) if isinstance(out, list) else [None] * n
    marked = [None if r.error is None else f"failed: {r.error}" for r in reqs]
    if problem is None:
        results = out if isinstance(out, list) else [None] * n
        return [m or o for m, o in zip(marked, results)]
    if n == 1:
        return [marked[0] or problem]
    if not replay_safe:
        return [m or Unblamed(problem) for m in marked]
    return [isolate(call, items.select([i]) if isinstance(items, VerifiedBatch) else [reqs[i]],
                    check, True, raised)[0] for i in range(n)]


def first_problem(outcomes: list) -> str:
    return next(o.problem for o in outcomes if isinstance(o, Unblamed))


def saved_by_retry(raised: list[tuple[int, Exception]], outcomes: list) -> Exception | None:
    """What a call for several requests raised when, retried one by one, none of them failed
    (the retry saved the step: the bug is in the batched call alone); else None."""
    batched = [e for n, e in raised if n > 1]
    if batched and not any(isinstance(o, (str, Unblamed)) for o in outcomes):
        return batched[0]
    return None
