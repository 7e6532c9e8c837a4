"""The plugin manager and the name registries built from it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pluggy

from specdec.hookspecs import PROJECT, SpecdecHookSpec

DISABLE_AUTOLOAD_ENV = "SPECDEC_DISABLE_PLUGIN_AUTOLOAD"


class PluginError(RuntimeError):
    """A plugin failed; the message names it."""


def get_plugin_manager(extra_plugins: tuple = ()) -> pluggy.PluginManager:
    """A fresh manager: built-ins, entry points of group `specdec` (unless
    SPECDEC_DISABLE_PLUGIN_AUTOLOAD=1), then `extra_plugins` (modules or objects)."""
    from specdec import builtins

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(SpecdecHookSpec)
    pm.register(builtins, name="specdec.builtins")
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "True"):
        try:
            pm.load_setuptools_entrypoints(PROJECT)
        except Exception as e:
            raise PluginError(f"loading a '{PROJECT}' entry-point plugin failed: {e!r}") from e
    for plugin in extra_plugins:
        pm.register(plugin, name=getattr(plugin, "__name__", type(plugin).__name__))
    pm.check_pending()
    return pm


def collect(pm: pluggy.PluginManager, hook_name: str) -> dict[str, tuple[Callable, str]]:
    """{name: (factory, plugin_name)} from every implementation of a registration hook."""
    found: dict[str, tuple[Callable, str]] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        try:
            entries = impl.function() or {}
        except Exception as e:
            raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook_name}: {e!r}") from e
        if not isinstance(entries, dict):
            raise PluginError(f"plugin {impl.plugin_name!r}: {hook_name} must return a dict")
        for name, factory in entries.items():
            if name in found:
                raise PluginError(
                    f"{hook_name}: name {name!r} registered by both {found[name][1]!r} "
                    f"and {impl.plugin_name!r}"
                )
            found[name] = (factory, impl.plugin_name)
    return found


def create(pm: pluggy.PluginManager, hook_name: str, kind: str, name: str, /, *args, **kwargs):
    """Instantiate `name` from a registration hook; errors list the names and name the plugin.

    The first four parameters are positional-only, so user keyword arguments (drafter_args,
    controller_args) may use any key, `name` and `kind` included: all reach the factory.
    """
    registry = collect(pm, hook_name)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(registry))}")
    factory, plugin = registry[name]
    try:
        obj = factory(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{kind} {name!r} (plugin {plugin!r}): {e}") from e
    except Exception as e:
        raise PluginError(f"{kind} {name!r} (plugin {plugin!r}) failed to start: {e!r}") from e
    obj.plugin_name = plugin
    return obj


def label(plugin) -> str:
    """``'name' (plugin 'registered-by')``: how failure messages name a plugin object."""
    return f"{plugin.name!r} (plugin {plugin.plugin_name!r})"


def notify_step_end(pm: pluggy.PluginManager, stats) -> list[str]:
    """Call every step observer; a failing one is reported by name (warning + returned), and
    does not stop the others or the engine."""
    errors = []
    for impl in pm.hook.specdec_step_end.get_hookimpls():
        try:
            impl.function(stats=stats)
        except Exception as e:
            msg = f"plugin {impl.plugin_name!r} failed in specdec_step_end: {e!r}"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            errors.append(msg)
    return errors
