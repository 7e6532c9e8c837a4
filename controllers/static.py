"""Static controller: the same draft budget for every request, every step."""

from __future__ import annotations

from specdec.controllers.base import RequestView, StepOutcome


class StaticController:
    """`budget` draft-tree nodes per request per step; 0 turns speculation off."""

    name = "static"

    def __init__(self, budget: int = 8) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"controller_args.budget must be an int >= 0, got {budget!r}")
        self.budget = budget

    def budgets(self, requests: list[RequestView], batch_size: int) -> list[int]:
        return [self.budget] * len(requests)

    def observe(self, outcomes: list[StepOutcome], step_seconds: float) -> None:
        return None
