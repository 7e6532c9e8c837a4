"""The plugin manager and the name registries built from it.

What cannot be used is skipped, not fatal: an entry point that fails to import (or to register)
and a registration hook that raises or returns something other than a dict are skipped with one
``RuntimeWarning`` naming the plugin (entry point, ``module:attr``, distribution and version) and
the error; they are an error only when a name is asked for that nothing registered (``create``:
a ValueError naming them, chained to the original error). A plugin that raises while the engine
runs is reported by the engine (``Raised``, ``Faults``: counted by plugin, the first of each kind
logged with its traceback).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pluggy

from specdec.hookspecs import PROJECT, SpecdecHookSpec
from specdec.plugin_errors import PluginError, label  # noqa: F401 (re-exported)

DISABLE_AUTOLOAD_ENV = "SPECDEC_DISABLE_PLUGIN_AUTOLOAD"

logger = logging.getLogger("specdec.plugins")


@dataclass(frozen=True)
class Origin:
    """Where an entry-point plugin comes from."""

    entry_point: str  # its name in group `specdec`: the plugin's registered name
    value: str  # "module:attr"
    dist: str  # the distribution's name
    version: str

    def __str__(self) -> str:
        return f"entry point {self.entry_point} = {self.value!r} of {self.dist} {self.version}"


@dataclass(frozen=True)
class Skipped:
    """A plugin left out: it did not load (``hook`` None), or one registration hook of it
    raised or returned something that is not a dict (``hook``: that hook)."""

    plugin: str
    origin: Origin | None  # None: registered by the program (LLM(plugins=...)), not installed
    hook: str | None
    error: BaseException

    def __str__(self) -> str:
        where = f" ({self.origin})" if self.origin is not None else ""
        what = "could not be loaded" if self.hook is None else f"failed in {self.hook}"
        return f"plugin {self.plugin!r}{where} {what}: {self.error!r}"


class PluginManager(pluggy.PluginManager):
    """pluggy's manager of project `specdec`, plus where each entry-point plugin came from
    (``origins``) and what was skipped (``skipped``: by (plugin, hook or None))."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.origins: dict[str, Origin] = {}
        self.skipped: dict[tuple[str, str | None], Skipped] = {}

    def skip(self, skipped: Skipped) -> None:
        """Leave a plugin (or one hook of it) out, with one warning naming it. The warning is
        issued from one place with the same text, so Python's warning filter shows it once per
        process however many managers are built (the CLI builds two)."""
        self.skipped[(skipped.plugin, skipped.hook)] = skipped
        warnings.warn(f"{skipped}; skipped: what it registers is not available (an error only "
                      "where it is asked for by name)", RuntimeWarning, stacklevel=1)


def get_plugin_manager(extra_plugins: tuple = ()) -> PluginManager:
    """A fresh manager: built-ins, entry points of group `specdec` (unless
    SPECDEC_DISABLE_PLUGIN_AUTOLOAD=1; one that cannot be loaded is skipped: ``skip``), then
    `extra_plugins` (modules or objects)."""
    from specdec import builtins

    pm = PluginManager()
    pm.add_hookspecs(SpecdecHookSpec)
    pm.register(builtins, name="specdec.builtins")
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "True"):
        _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin, name=getattr(plugin, "__name__", type(plugin).__name__))
    pm.check_pending()
    return pm


def _load_entry_points(pm: PluginManager) -> None:
    """pluggy's ``load_setuptools_entrypoints``, one entry point at a time: one that fails to
    import, to register or names a hook `specdec` does not have is skipped."""
    for dist in list(importlib.metadata.distributions()):
        for ep in dist.entry_points:
            if ep.group != PROJECT or pm.has_plugin(ep.name) or pm.is_blocked(ep.name) \
                    or (ep.name, None) in pm.skipped:
                continue
            origin = Origin(ep.name, ep.value, dist.name, dist.version)
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
                _check_hooks_known(pm, plugin)
            except Exception as e:
                if pm.has_plugin(ep.name):
                    pm.unregister(name=ep.name)
                pm.skip(Skipped(ep.name, origin, None, e))
                continue
            pm.origins[ep.name] = origin


def _check_hooks_known(pm: PluginManager, plugin) -> None:
    """What ``check_pending`` says of the whole manager, for one plugin."""
    for caller in pm.get_hookcallers(plugin) or ():
        if not caller.has_spec() and any(i.plugin is plugin and not i.optionalhook
                                         for i in caller.get_hookimpls()):
            raise pluggy.PluginValidationError(
                plugin, f"unknown hook {caller.name!r} (the hooks: specdec.hookspecs)")


def collect(pm: PluginManager, hook_name: str) -> dict[str, tuple[Callable, str]]:
    """{name: (factory, plugin_name)} from every implementation of a registration hook; one
    that raises or returns no dict is skipped (``PluginManager.skip``)."""
    found: dict[str, tuple[Callable, str]] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if (impl.plugin_name, hook_name) in pm.skipped:
            continue
        try:
            entries = impl.function() or {}
            if not isinstance(entries, dict):
                raise TypeError(f"{hook_name} must return a dict, got {type(entries).__name__}")
        except Exception as e:
            pm.skip(Skipped(impl.plugin_name, pm.origins.get(impl.plugin_name), hook_name, e))
            continue
        for name, factory in entries.items():
            if name in found:
                raise PluginError(
                    f"{hook_name}: name {name!r} registered by both {found[name][1]!r} "
                    f"and {impl.plugin_name!r}"
                )
            found[name] = (factory, impl.plugin_name)
    return found


def check_name(pm: PluginManager, hook_name: str, kind: str, name: str,
               registry: dict | None = None) -> None:
    """ValueError when nothing registered ``name`` through ``hook_name``, listing the names
    and naming the skipped plugins that may have registered it (``skipped_note``), chained to
    the error of the one whose entry point is called ``name``, else of the first."""
    registry = collect(pm, hook_name) if registry is None else registry
    if name in registry:
        return
    missing = _skipped_for(pm, hook_name, name)
    raise ValueError(f"unknown {kind} {name!r}; registered: "
                     f"{', '.join(sorted(registry)) or '(none)'}{skipped_note(pm, hook_name, name)}"
                     ) from (missing[0].error if missing else None)


def skipped_note(pm: PluginManager, hook_name: str, name: str) -> str:
    """What an unknown-name error adds: the skipped plugins that may have registered ``name``
    through ``hook_name`` ("" when none was skipped)."""
    missing = _skipped_for(pm, hook_name, name)
    if missing and missing[0].plugin == name:
        return f"; the plugin of that name was skipped: {missing[0]}"
    if missing:
        return f"; skipped, and perhaps what registers it: {'; '.join(map(str, missing))}"
    return ""


def _skipped_for(pm: PluginManager, hook_name: str, name: str) -> list[Skipped]:
    """The skipped plugins that could have registered ``name`` by ``hook_name``; the plugin
    called ``name`` first."""
    missing = [s for s in pm.skipped.values() if s.hook in (None, hook_name)]
    return sorted(missing, key=lambda s: s.plugin != name)


def create(pm: PluginManager, hook_name: str, kind: str, name: str, /, *args, **kwargs):
    """Instantiate `name` from a registration hook; errors list the names and name the plugin
    (a skipped plugin that may have registered it: ``check_name``).

    The first four parameters are positional-only, so user keyword arguments (drafter_args,
    controller_args) may use any key, `name` and `kind` included: all reach the factory.
    """
    registry = collect(pm, hook_name)
    check_name(pm, hook_name, kind, name, registry)
    factory, plugin = registry[name]
    try:
        obj = factory(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{kind} {name!r} (plugin {plugin!r}): {e}") from e
    except Exception as e:
        raise PluginError(f"{kind} {name!r} (plugin {plugin!r}) failed to start: {e!r}",
                          plugin) from e
    obj.plugin_name = plugin
    return obj


# ---- what raised while the engine ran -------------------------------------------------------

@dataclass(frozen=True)
class Raised:
    """A plugin call that raised, whatever came of it (a request failed, a report, or nothing
    when a retry saved the step): the plugin by its registered name, the call (``where``:
    e.g. "drafter 'ngram' propose") and the exception, with its traceback."""

    plugin: str
    where: str
    error: BaseException

    @classmethod
    def of(cls, plugin: str, where: str, error: BaseException) -> Raised:
        """A PluginError naming another plugin (a composition's member) is that plugin's."""
        named = getattr(error, "plugin", None) if isinstance(error, PluginError) else None
        return cls(named or plugin, where, error)

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} raised in {self.where}: {self.error!r}"


class Faults:
    """Every plugin exception an engine met, once: counted by plugin (``counts``: what the
    server's /metrics exports), the first of each kind (plugin, call, exception type) logged
    with its traceback, the others counted by kind (``repeats``), so a plugin failing the same
    way every step does not flood the log."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.repeats: dict[tuple[str, str, str], int] = {}

    def add(self, raised: list[Raised]) -> None:
        for r in raised:
            self.counts[r.plugin] = self.counts.get(r.plugin, 0) + 1
            kind = (r.plugin, r.where, type(r.error).__name__)
            if kind in self.repeats:
                self.repeats[kind] += 1
                continue
            self.repeats[kind] = 0
            logger.error("%s (logged once: a later %s of this plugin in this call is counted, "
                         "not logged)", r, type(r.error).__name__, exc_info=r.error)


def notify_step_end(pm: PluginManager, stats) -> tuple[list[str], list[Raised]]:
    """Call every step observer; a failing one is reported by name (warning + returned, with
    what it raised), and does not stop the others or the engine."""
    errors, raised = [], []
    for impl in pm.hook.specdec_step_end.get_hookimpls():
        try:
            impl.function(stats=stats)
        except Exception as e:
            msg = f"plugin {impl.plugin_name!r} failed in specdec_step_end: {e!r}"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            errors.append(msg)
            raised.append(Raised(impl.plugin_name, "specdec_step_end", e))
    return errors, raised
