"""The drafter and the controller an engine runs with, made from the registries by the
config's names (a composition "a+b" from each member's), fitted to the declared contracts (a
plugin that does not subclass ``BaseDrafter`` / ``BaseController`` is adapted once, here) and
checked at start-up: every drafter's ``hidden_layers`` are target layers; a drafter that restores
no prefix-cache hit is said once in the log (drafters/base.py, "Prefix caching")."""

from __future__ import annotations

import logging

import pluggy

from specdec import plugins
from specdec.config import EngineConfig
from specdec.controllers.adapter import as_controller
from specdec.controllers.base import BaseController
from specdec.drafters.adapter import as_drafter
from specdec.drafters.base import BaseDrafter, TargetInfo
from specdec.drafters.compose import ComposedDrafter

logger = logging.getLogger("specdec")


def create_drafter_and_controller(pm: pluggy.PluginManager, config: EngineConfig,
                                  target: TargetInfo
                                  ) -> tuple[BaseDrafter | None, BaseController]:
    """(drafter or None, controller) from the registries, by the config's names."""
    drafter = None
    if config.drafter is not None:
        members = [_drafter(pm, name, target, args)
                   for name, args in _member_args(config.drafter, config.drafter_args)]
        if config.enable_prefix_caching:
            _say_if_no_restore(members)
        drafter = members[0] if len(members) == 1 else ComposedDrafter(members)
    controller = plugins.create(pm, "specdec_controllers", "controller", config.controller_name,
                                **config.controller_args)
    return drafter, as_controller(controller)


def composition_names(spec: str) -> list[str]:
    """The registered names a drafter name stands for: ``"eagle3+ngram"`` -> ["eagle3",
    "ngram"] (a composition's members, in order), ``"ngram"`` -> ["ngram"]; ValueError when a
    composition names a member twice or leaves one empty. What the CLI checks names with."""
    if "+" not in spec:
        return [spec]
    names = spec.split("+")
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"drafter {spec!r}: name each drafter once, e.g. 'eagle3+ngram'")
    return names


def _member_args(spec: str, args: dict) -> list[tuple[str, dict]]:
    """(name, drafter_args) per drafter of ``spec``; a composition ``"a+b"`` takes drafter_args
    keyed by member, ``{"a": {...}, "b": {...}}``."""
    if "+" not in spec:
        return [(spec, args)]
    names = composition_names(spec)
    unknown = set(args) - set(names)
    if unknown or not all(isinstance(v, dict) for v in args.values()):
        raise ValueError(f"drafter {spec!r} takes drafter_args keyed by drafter name, e.g. "
                         f"{{{names[0]!r}: {{...}}}}; got keys {sorted(args)}")
    return [(n, args.get(n, {})) for n in names]


def _drafter(pm: pluggy.PluginManager, name: str, target: TargetInfo, args: dict
             ) -> BaseDrafter:
    """The registry's drafter ``name``, adapted, its ``hidden_layers`` checked against the
    target."""
    drafter = as_drafter(plugins.create(pm, "specdec_drafters", "drafter", name, target, **args))
    _check_hidden_layers(drafter, target.model_config.num_layers)
    return drafter


def _check_hidden_layers(drafter: BaseDrafter, num_layers: int) -> None:
    """A drafter's ``hidden_layers`` are target layer indices in [0, num_layers)."""
    layers = drafter.hidden_layers
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool)
           or not 0 <= i < num_layers] if isinstance(layers, (tuple, list)) else [layers]
    if bad:
        raise ValueError(f"drafter {plugins.label(drafter)}: hidden_layers must be a tuple of "
                         f"ints in [0, {num_layers}) (the target's layers), got {layers!r}")


def _say_if_no_restore(drafters: list[BaseDrafter]) -> None:
    """Once per engine: a drafter that restores no prefix-cache hit turns the reuse off for its
    requests (drafters/base.py, "Prefix caching")."""
    for d in drafters:
        if not d.restores_prefix:
            logger.warning(
                "drafter %r (plugin %r) has no restore() and does not declare "
                "prefix_cache_safe = True: its requests recompute every prefix-cache hit (second "
                "chat turns, shared system prompts, preempted requests, n > 1 samples); outputs "
                "are unchanged. See 'Prefix caching' in drafters/base.py",
                d.name, d.plugin_name)
