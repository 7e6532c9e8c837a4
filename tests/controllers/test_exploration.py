"""The exploration clock alone: due_within predicts step, backoff doubles and resets."""

from __future__ import annotations

from specdec.controllers.exploration import MAX_BACKOFF, ExplorationClock


def _steps_until_explored(clock: ExplorationClock, ids: list[str], who: str, limit: int) -> int:
    for n in range(1, limit + 1):
        explored = clock.step(ids, [0] * len(ids))
        if ids.index(who) in explored:
            return n
    return limit + 1


def test_due_within_predicts_the_step_that_explores():
    for batch in (1, 3):
        ids = [f"r{i}" for i in range(batch)]
        clock = ExplorationClock(every=4)
        clock.step(ids, [0] * batch)
        for _ in range(3):  # through a few explorations, backoff included
            ahead = [k for k in range(0, 200) if clock.due_within("r0", k)]
            first = ahead[0] if ahead else None
            shadow = ExplorationClock(every=4)
            shadow.__dict__.update({k: (v.copy() if hasattr(v, "copy") else v)
                                    for k, v in clock.__dict__.items()})
            assert first == _steps_until_explored(shadow, ids, "r0", 200)
            _steps_until_explored(clock, ids, "r0", 200)
            clock.drafted("r0")


def test_backoff_doubles_while_explorations_do_not_pay_and_drafting_resets_it():
    clock = ExplorationClock(every=2)
    for _ in range(6):
        _steps_until_explored(clock, ["a"], "a", 100)
        clock.drafted("a")
    clock.step(["a"], [0])
    assert clock.backoff["a"] == MAX_BACKOFF and clock.carried == MAX_BACKOFF
    assert clock.step(["b"], [0]) == [] and clock.backoff["b"] == MAX_BACKOFF  # carried over
    clock.step(["a"], [2])  # the plan drafts it: back to the base interval, for new ones too
    assert clock.backoff["a"] == 1 and clock.carried == 1


def test_never_explores_with_every_zero():
    clock = ExplorationClock(every=0)
    assert all(clock.step(["a"], [0]) == [] for _ in range(500))
    assert not clock.due_within("a", 10**6)
