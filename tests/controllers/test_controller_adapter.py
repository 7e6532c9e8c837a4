"""A controller plugin that does not subclass BaseController is fitted to the declared contract
once: its own methods where it has them (looked up when called), the defaults for the rest."""

from __future__ import annotations

from specdec.controllers.adapter import PluginController, as_controller
from specdec.controllers.base import BaseController, Controller, DraftBudget, RequestView
from specdec.controllers.static import StaticController
from specdec.tree import DraftTree

VIEW = RequestView("r", 5, 1, 1, 0, (), 0, 0)


class Minimal:
    name = "minimal"

    def budgets(self, requests, batch):
        return [DraftBudget(2)] * len(requests)

    def observe(self, report):
        self.seen = report


class Full(Minimal):
    plugin_name = "mine"
    decision = {"depth": 2}

    def prune(self, requests, trees, batch):
        return [[0]] * len(trees)

    def keep_drafting(self, request, recompute_tokens):
        return False


def test_a_subclass_is_used_as_it_is():
    c = StaticController()
    assert as_controller(c) is c and isinstance(c, Controller)


def test_a_minimal_plugin_gets_the_defaults():
    c = as_controller(Minimal())
    assert isinstance(c, PluginController) and isinstance(c, Controller)
    tree = DraftTree.chain([1, 2])
    assert c.prune([VIEW], [tree], None) == [None]
    assert c.keep_drafting(VIEW, 8) is True
    assert c.release("r") is None and c.setup(None) is None
    assert dict(c.decision) == {} and c.plugin_name == BaseController.plugin_name
    assert c.budgets([VIEW], None) == [DraftBudget(2)]


def test_a_plugin_s_own_optional_members_are_used():
    plugin = Full()
    c = as_controller(plugin)
    assert c.prune([VIEW], [DraftTree.chain([1])], None) == [[0]]
    assert c.keep_drafting(VIEW, 0) is False and c.plugin_name == "mine"
    plugin.decision = {"depth": 3}  # read when asked, not copied at start-up
    assert c.decision == {"depth": 3}
