"""Plugin manager: builtins plus entry points of group ``dtorch``, filling the registries.

Environment switches:
  ``DTORCH_DISABLE_PLUGINS``  comma list of plugin names not to load (builtins included)
  ``DTORCH_TRACE_PLUGINS=1``  log every hook call with its plugin (structlog, debug level)
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

import attrs
import pluggy
import structlog

from . import hookspecs
from .errors import PluginError
from .registry import Registry

log = structlog.get_logger(__name__)

ENTRY_POINT_GROUP = "dtorch"
REGISTRATION_HOOKS = {
    "ops": "dtorch_register_ops",
    "kernels": "dtorch_register_kernels",
    "streams": "dtorch_register_streams",
    "communicators": "dtorch_register_communicators",
    "transports": "dtorch_register_transports",
    "runners": "dtorch_register_runners",
    "model_families": "dtorch_register_model_families",
    "cli_commands": "dtorch_register_cli_commands",
}
BUILTIN_PLUGINS = (
    ("dtorch.ops", "dtorch_core.ops.builtin"),
    ("dtorch.runtime", "dtorch_core.runners.builtin"),
    ("dtorch.cli", "dtorch_core.cli"),
    ("dtorch.checkpoint", "dtorch_core.checkpoint.plugin"),
)


@attrs.define
class Plugins:
    """The loaded plugins and the registries they filled."""

    manager: pluggy.PluginManager
    registries: dict[str, Registry]
    disabled: tuple[str, ...]

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def describe(self) -> list[tuple[str, list[str]]]:
        """(plugin name, hooks it implements) for every loaded plugin."""
        out = []
        for name, plugin in self.manager.list_name_plugin():
            hooks = sorted(c.name for c in self.manager.get_hookcallers(plugin) or [])
            out.append((name, hooks))
        return out


def _disabled() -> tuple[str, ...]:
    raw = os.environ.get("DTORCH_DISABLE_PLUGINS", "")
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def _make_registry(kind: str) -> Registry:
    if kind == "ops":
        from .planner.schema import OpRegistry

        return OpRegistry(kind)
    if kind == "kernels":
        from .worker.kernels import KernelRegistry

        return KernelRegistry(kind)
    return Registry(kind)


def build_plugins() -> Plugins:
    """Load builtins and entry points, then call every registration hook once."""
    import importlib

    pm = pluggy.PluginManager("dtorch")
    pm.add_hookspecs(hookspecs)
    disabled = _disabled()
    for name, module in BUILTIN_PLUGINS:
        if name not in disabled:
            pm.register(importlib.import_module(module), name=name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled or pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to load: {exc!r}; "
                f"fix or uninstall it, or set DTORCH_DISABLE_PLUGINS={ep.name}"
            ) from exc
    trace = os.environ.get("DTORCH_TRACE_PLUGINS", "") not in ("", "0")
    if trace:
        pm.trace.root.setwriter(lambda msg: log.debug("pluggy", msg=msg.rstrip()))
        pm.enable_tracing()
    registries = {}
    for kind, hook_name in REGISTRATION_HOOKS.items():
        registry = _make_registry(kind)
        for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
            registry.current_plugin = impl.plugin_name
            if trace:
                log.debug("plugin hook", plugin=impl.plugin_name, hook=hook_name)
            try:
                impl.function(registry=registry)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook_name}: {exc!r}") from exc
        registry.current_plugin = "?"
        registries[kind] = registry
    return Plugins(pm, registries, disabled)


_lock = threading.Lock()
_plugins: Plugins | None = None


def get_plugins() -> Plugins:
    global _plugins
    with _lock:
        if _plugins is None:
            _plugins = build_plugins()
        return _plugins


def reset_plugins() -> None:
    """Forget the loaded plugins (tests that install or disable plugins call this)."""
    global _plugins
    with _lock:
        _plugins = None
