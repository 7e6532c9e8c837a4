"""A controller that does not subclass ``BaseController``, fitted to the declared contract once at
start-up (``as_controller``): its own methods where it has them, ``BaseController``'s defaults for
the rest, so the engine calls declared methods only. Its methods are looked up when called, so
a plugin may still swap one on its instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specdec.controllers.base import (
    BaseController,
    BatchComposition,
    ControllerContext,
    DraftBudget,
    RequestView,
    StepReport,
)
from specdec.tree import DraftTree

OPTIONAL = ("setup", "prune", "keep_drafting", "release", "decision", "plugin_name")


def as_controller(controller) -> BaseController:
    """The controller itself when it subclasses ``BaseController``, else adapted."""
    return controller if isinstance(controller, BaseController) else PluginController(controller)


class PluginController(BaseController):
    def __init__(self, plugin) -> None:
        self.plugin = plugin
        # the one place its optional members are looked for: once, here
        self.has = frozenset(m for m in OPTIONAL if hasattr(plugin, m))
        self.name = plugin.name
        if "plugin_name" in self.has:  # set by the registry; not on one made by hand
            self.plugin_name = plugin.plugin_name

    @property
    def decision(self) -> Mapping[str, Any]:
        return self.plugin.decision if "decision" in self.has else BaseController.decision

    def budgets(self, requests: list[RequestView], batch: BatchComposition) -> list[DraftBudget]:
        return self.plugin.budgets(requests, batch)

    def observe(self, report: StepReport) -> None:
        self.plugin.observe(report)

    def setup(self, context: ControllerContext) -> None:
        if "setup" in self.has:
            self.plugin.setup(context)

    def prune(self, requests: list[RequestView], trees: list[DraftTree],
              batch: BatchComposition) -> list[list[int] | None]:
        if "prune" not in self.has:
            return super().prune(requests, trees, batch)
        return self.plugin.prune(requests, trees, batch)

    def keep_drafting(self, request: RequestView, recompute_tokens: int) -> bool:
        if "keep_drafting" not in self.has:
            return super().keep_drafting(request, recompute_tokens)
        return self.plugin.keep_drafting(request, recompute_tokens)

    def release(self, request_id: str) -> None:
        if "release" in self.has:
            self.plugin.release(request_id)
