"""A drafter that does not subclass ``BaseDrafter``, fitted to the declared contract once at
start-up (``as_drafter``): its own members where it has them, ``BaseDrafter``'s defaults for the
rest, so the engine (and a composition) calls declared methods only. Its methods are looked up
when called, so a plugin may still swap one on its instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specdec.drafters.base import BaseDrafter, DraftRequest, TokenView, VerifiedBatch
from specdec.tree import DraftTree

OPTIONAL = ("plugin_name", "hidden_layers", "replay_safe", "prefix_cache_safe", "matmul_models",
            "sources", "last_source_seconds", "init_state", "on_verified", "release", "restore")


def as_drafter(drafter) -> BaseDrafter:
    """The drafter itself when it subclasses ``BaseDrafter``, else adapted."""
    return drafter if isinstance(drafter, BaseDrafter) else PluginDrafter(drafter)


class PluginDrafter(BaseDrafter):
    def __init__(self, plugin) -> None:
        self.plugin = plugin
        self.name = plugin.name
        # the one place its optional members are looked for: once, here
        has = self.has = frozenset(m for m in OPTIONAL if hasattr(plugin, m))
        if "plugin_name" in has:  # set by the registry; not on one made by hand
            self.plugin_name = plugin.plugin_name
        if "hidden_layers" in has:
            self.hidden_layers = plugin.hidden_layers
        if "replay_safe" in has:
            self.replay_safe = plugin.replay_safe
        if "prefix_cache_safe" in has:
            self.prefix_cache_safe = plugin.prefix_cache_safe
        if "matmul_models" in has:
            self.matmul_models = tuple(plugin.matmul_models)
        if "sources" in has:
            self.sources = tuple(plugin.sources)

    @property
    def last_source_seconds(self) -> Mapping[str, float]:
        if "last_source_seconds" in self.has:
            return self.plugin.last_source_seconds
        return BaseDrafter.last_source_seconds

    @property
    def restores_prefix(self) -> bool:
        return self.prefix_cache_safe or "restore" in self.has

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return self.plugin.propose(requests)

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        if "init_state" in self.has:
            return self.plugin.init_state(request_id, prompt_token_ids)
        return None

    def on_verified(self, batch: VerifiedBatch) -> None:
        if "on_verified" in self.has:
            self.plugin.on_verified(batch)

    def release(self, state: Any) -> None:
        if "release" in self.has:
            self.plugin.release(state)

    def restore(self, state: Any, token_ids: TokenView, page_keys: list[bytes]) -> int:
        if "restore" in self.has:
            return self.plugin.restore(state, token_ids, page_keys)
        return super().restore(state, token_ids, page_keys)
