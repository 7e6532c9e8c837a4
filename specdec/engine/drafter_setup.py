"""The drafter and the controller an engine runs with, made from the registries by the
config's names (a composition "a+b" from each member's), and checked at start-up: every
drafter's ``hidden_layers`` are target layers; a drafter that restores no prefix-cache hit
is said once in the log (drafters/base.py, "Prefix caching")."""

from __future__ import annotations

import logging

from specdec import plugins
from specdec.drafters.base import BaseDrafter, TargetInfo
from specdec.drafters.compose import ComposedDrafter

logger = logging.getLogger("specdec")


def create_drafter_and_controller(pm, config, target: TargetInfo) -> tuple:
    """(drafter or None, controller) from the registries, by the config's names."""
    drafter = None
    if config.drafter is not None and "+" in config.drafter:
        drafter = _composed(pm, config.drafter, config.drafter_args, target)
    elif config.drafter is not None:
        drafter = _drafter(pm, config.drafter, target, config.drafter_args)
    if drafter is not None and config.enable_prefix_caching:
        _say_if_no_restore(getattr(drafter, "drafters", None) or [drafter])
    controller = plugins.create(pm, "specdec_controllers", "controller", config.controller_name,
                                **config.controller_args)
    return drafter, controller


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


def _composed(pm, spec: str, args: dict, target: TargetInfo) -> ComposedDrafter:
    """``"a+b"`` with drafter_args ``{"a": {...}, "b": {...}}``: the drafters merged in order."""
    names = composition_names(spec)
    unknown = set(args) - set(names)
    if unknown or not all(isinstance(v, dict) for v in args.values()):
        raise ValueError(f"drafter {spec!r} takes drafter_args keyed by drafter name, e.g. "
                         f"{{{names[0]!r}: {{...}}}}; got keys {sorted(args)}")
    return ComposedDrafter([_drafter(pm, n, target, args.get(n, {})) for n in names])


def _drafter(pm, name: str, target: TargetInfo, args: dict):
    """The registry's drafter ``name``, its ``hidden_layers`` checked against the target."""
    drafter = plugins.create(pm, "specdec_drafters", "drafter", name, target, **args)
    _check_hidden_layers(drafter, target.model_config.num_layers)
    return drafter


def _check_hidden_layers(drafter, num_layers: int) -> None:
    """A drafter's ``hidden_layers`` are target layer indices in [0, num_layers)."""
    layers = getattr(drafter, "hidden_layers", ())
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool)
           or not 0 <= i < num_layers] if isinstance(layers, (tuple, list)) else [layers]
    if bad:
        raise ValueError(f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} "
                         f"(plugin {getattr(drafter, 'plugin_name', '?')!r}): hidden_layers "
                         f"must be a tuple of ints in [0, {num_layers}) (the target's layers), "
                         f"got {layers!r}")


def _say_if_no_restore(drafters) -> None:
    """Once per engine: a drafter that restores no prefix-cache hit turns the reuse off for its
    requests (drafters/base.py, "Prefix caching")."""
    for d in drafters:
        hook = getattr(type(d), "restore", None) if isinstance(d, BaseDrafter) else getattr(
            d, "restore", None)
        if hook is None or (hook is BaseDrafter.restore and not d.prefix_cache_safe):
            logger.warning(
                "drafter %r (plugin %r) has no restore() and does not declare "
                "prefix_cache_safe = True: its requests recompute every prefix-cache hit (second "
                "chat turns, shared system prompts, preempted requests, n > 1 samples); outputs "
                "are unchanged. See 'Prefix caching' in specdec/drafters/base.py",
                getattr(d, "name", type(d).__name__), getattr(d, "plugin_name", "?"))


def drafter_sources(drafter) -> tuple[str, ...]:
    """A composed drafter's member names (what DraftBudget.sources may name); () else."""
    return tuple(d.name for d in getattr(drafter, "drafters", ()))
