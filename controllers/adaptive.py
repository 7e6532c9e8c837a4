"""Adaptive controller: an acceptance-only baseline, the schedule of HF transformers' assisted
generation ("heuristic"): per request, the draft length grows by 2 after a step whose draft was
accepted whole and shrinks by 1 (not below 1) after one with a rejection. It never turns
speculation off and knows nothing of cost: the goodput controller's comparison point.
"""

from __future__ import annotations

from specdec.controllers.base import (
    BaseController,
    BatchComposition,
    DraftBudget,
    RequestView,
    StepReport,
)


class AdaptiveController(BaseController):
    name = "adaptive"

    def __init__(self, start: int = 4, budget: int = 16, grow: int = 2, shrink: int = 1) -> None:
        for key, value, low in (("start", start, 1), ("budget", budget, 1), ("grow", grow, 0),
                                ("shrink", shrink, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"controller_args.{key} must be an int >= {low}, got {value!r}")
        self.start, self.budget = min(start, budget), budget
        self.grow, self.shrink = grow, shrink
        self.length: dict[str, int] = {}

    def budgets(self, requests: list[RequestView], batch: BatchComposition) -> list[DraftBudget]:
        return [DraftBudget(self.length.setdefault(r.request_id, self.start), None)
                for r in requests]

    def release(self, request_id: str) -> None:
        """The request ended: a request reusing the id starts again from ``start``."""
        self.length.pop(request_id, None)

    def observe(self, report: StepReport) -> None:
        for o in report.outcomes:
            if o.num_proposed == 0 or o.request_id not in self.length:
                continue
            n = self.length[o.request_id]
            whole = o.num_accepted >= (o.tree.max_depth + 1 if o.tree is not None
                                       else o.num_proposed)
            n = n + self.grow if whole else n - self.shrink
            self.length[o.request_id] = max(1, min(self.budget, n))
