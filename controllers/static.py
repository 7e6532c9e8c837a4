"""Static controller: the same draft budget for every request, every step."""

from __future__ import annotations

from specdec.controllers.base import (
    BaseController,
    BatchComposition,
    DraftBudget,
    RequestView,
    StepReport,
)


class StaticController(BaseController):
    """`budget` draft-tree nodes per request per step (0 turns speculation off); `max_depth`
    optionally caps how deep a tree may go."""

    name = "static"

    def __init__(self, budget: int = 8, max_depth: int | None = None) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"controller_args.budget must be an int >= 0, got {budget!r}")
        if max_depth is not None and (not isinstance(max_depth, int) or isinstance(max_depth, bool)
                                      or max_depth < 1):
            raise ValueError(
                f"controller_args.max_depth must be None or an int >= 1, got {max_depth!r}")
        self.budget = DraftBudget(budget, max_depth)

    def budgets(self, requests: list[RequestView], batch: BatchComposition) -> list[DraftBudget]:
        return [self.budget] * len(requests)

    def observe(self, report: StepReport) -> None:
        return None
