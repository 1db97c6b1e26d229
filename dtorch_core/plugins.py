"""Plugin manager: builtins plus entry points of group ``dtorch``, filling the registries.

Environment switches:
  ``DTORCH_DISABLE_PLUGINS``  comma list of plugin names not to load (builtins included)
  ``DTORCH_TRACE_PLUGINS=1``  log every hook call with its plugin (structlog, debug level)
"""

from __future__ import annotations

import importlib
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
    """Load builtins and entry points, then call every registration hook once.

    Each hook is called through ``pm.hook.<name>(registry=...)``, so pluggy's wrappers, ordering
    (``tryfirst``/``trylast``) and tracing apply. Plugins are registered so that pluggy (which
    calls the last registered first) calls the builtins first, then the installed plugins in
    entry-point order: a plugin that replaces a builtin entry (``replace=True``) comes after it.
    """
    pm = pluggy.PluginManager("dtorch")
    pm.add_hookspecs(hookspecs)
    disabled = _disabled()
    builtin_names = {name for name, _ in BUILTIN_PLUGINS}
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled or ep.name in builtin_names or any(ep.name == n for n, _ in loaded):
            continue
        try:
            loaded.append((ep.name, ep.load()))
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to load: {exc!r}; "
                f"fix or uninstall it, or set DTORCH_DISABLE_PLUGINS={ep.name}"
            ) from exc
    builtins = [(name, importlib.import_module(module)) for name, module in BUILTIN_PLUGINS if name not in disabled]
    for name, plugin in reversed(builtins + loaded):
        pm.register(plugin, name=name)
    trace = os.environ.get("DTORCH_TRACE_PLUGINS", "") not in ("", "0")
    if trace:
        pm.trace.root.setwriter(lambda msg: log.debug("pluggy", msg=msg.rstrip()))
        pm.enable_tracing()
        pm.add_hookcall_monitoring(
            lambda hook_name, impls, kwargs: log.debug("plugin hook", hook=hook_name,
                                                       plugins=[impl.plugin_name for impl in impls]),
            lambda outcome, hook_name, impls, kwargs: None)
    registries = {}
    for kind, hook_name in REGISTRATION_HOOKS.items():
        hook = getattr(pm.hook, hook_name)
        registry = _make_registry(kind)
        registry.impl_owners = {impl.function.__code__: impl.plugin_name for impl in hook.get_hookimpls()}
        try:
            hook(registry=registry)
        except PluginError:
            raise
        except Exception as exc:
            owner = _raising_plugin(exc, registry.impl_owners)
            raise PluginError(f"plugin {owner!r} failed in {hook_name}: {exc!r}") from exc
        registries[kind] = registry
    return Plugins(pm, registries, disabled)


def _raising_plugin(exc: BaseException, impl_owners: dict) -> str:
    """The plugin whose hook implementation the exception went through (innermost), or "?"."""
    owner = "?"
    tb = exc.__traceback__
    while tb is not None:
        owner = impl_owners.get(tb.tb_frame.f_code, owner)
        tb = tb.tb_next
    return owner


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
