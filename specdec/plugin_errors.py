"""How a plugin's failure is named: an error that carries the plugin, and a plugin object's label.
Apart from specdec.plugins (which imports the built-in drafters through specdec.builtins) so
that a drafter may raise it without a package loop."""

from __future__ import annotations


class PluginError(RuntimeError):
    """A plugin failed; the message names it (``plugin``: its registered name, where known)."""

    def __init__(self, message: str, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


def label(plugin) -> str:
    """``'name' (plugin 'registered-by')``: how failure messages name a plugin object."""
    return f"{plugin.name!r} (plugin {plugin.plugin_name!r})"
