"""DraftBudget and the static controller."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.controllers.base import BatchComposition, Controller, DraftBudget, RequestView
from specdec.controllers.static import StaticController

BATCH = BatchComposition(num_decode=3, num_prefill_requests=1, num_prefill_tokens=7,
                         num_waiting=2, max_draft_rows=40)


def view(rid: str) -> RequestView:
    return RequestView(rid, 10, 2, 1, 3, (1,), 3, 1)


@pytest.mark.parametrize("budget, max_depth", [(8, None), (0, None), (5, 2), (1, 1)])
def test_same_budget_for_every_request_every_step(budget, max_depth):
    c = StaticController(budget, max_depth)
    assert isinstance(c, Controller) and c.name == "static"
    want = [DraftBudget(budget, max_depth)] * 3
    assert c.budgets([view("a"), view("b"), view("c")], BATCH) == want
    assert c.budgets([], BATCH) == []
    assert c.observe(None) is None
    assert c.budgets([view("a")] * 3, BATCH) == want


def test_default_budget():
    assert StaticController().budgets([view("a")], BATCH) == [DraftBudget(8)]


@pytest.mark.parametrize("kwargs, field", [
    (dict(budget=-1), "budget"), (dict(budget=2.0), "budget"), (dict(budget=True), "budget"),
    (dict(max_depth=0), "max_depth"), (dict(max_depth=1.5), "max_depth"),
    (dict(max_depth=False), "max_depth"),
])
def test_bad_args_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"controller_args\.{field} must be"):
        StaticController(**kwargs)


def test_draft_budget_depth_limit_and_clip():
    assert DraftBudget(6).depth_limit == 6 and DraftBudget(6, 2).depth_limit == 2
    assert DraftBudget(2, 5).depth_limit == 2
    b = DraftBudget(6, 2)
    assert b.clip(10) is b and b.clip(6) is b
    assert b.clip(3) == DraftBudget(3, 2) and b.clip(-4) == DraftBudget(0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.max_nodes = 3  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_nodes=-1), "max_nodes"), (dict(max_nodes=1.0), "max_nodes"),
    (dict(max_nodes=True), "max_nodes"), (dict(max_nodes=3, max_depth=0), "max_depth"),
    (dict(max_nodes=3, max_depth=True), "max_depth"),
])
def test_draft_budget_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"DraftBudget\.{field} must be"):
        DraftBudget(**kwargs)
