"""A drafter plugin that does not subclass BaseDrafter is fitted to the declared contract once:
its own members where it has them, BaseDrafter's defaults for the rest; whether a prefix-cache
hit can be reused for its requests follows from what it declares."""

from __future__ import annotations

from specdec.drafters.adapter import PluginDrafter, as_drafter
from specdec.drafters.base import BaseDrafter, Drafter, TokenView
from specdec.drafters.ngram import NgramDrafter
from specdec.tree import DraftTree


class Minimal:
    name = "minimal"

    def propose(self, requests):
        return [DraftTree.empty() for _ in requests]


class Restoring(Minimal):
    hidden_layers = (1,)
    replay_safe = True
    last_source_seconds = {"a": 0.5}

    def restore(self, state, token_ids, page_keys):
        return 1


def test_a_subclass_is_used_as_it_is():
    d = NgramDrafter(None)
    assert as_drafter(d) is d and isinstance(d, Drafter) and d.restores_prefix


def test_a_minimal_plugin_gets_the_defaults():
    d = as_drafter(Minimal())
    assert isinstance(d, PluginDrafter) and isinstance(d, Drafter)
    assert (d.hidden_layers, d.replay_safe, d.matmul_models, d.sources) == ((), False, (), ())
    assert d.init_state("r", [1]) is None and d.release(None) is None
    assert d.restore(None, TokenView([1, 2]), [b"k"]) == 0 and not d.restores_prefix
    assert dict(d.last_source_seconds) == {} and d.plugin_name == BaseDrafter.plugin_name


def test_a_plugin_s_own_members_are_used():
    d = as_drafter(Restoring())
    assert d.hidden_layers == (1,) and d.replay_safe is True
    assert d.restore(None, TokenView([1]), [b"a", b"b"]) == 1 and d.restores_prefix
    assert d.last_source_seconds == {"a": 0.5}
