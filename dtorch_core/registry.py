"""Named registries that plugins fill through the ``dtorch_register_*`` hooks."""

from __future__ import annotations

import sys
from typing import Any

import attrs

from .errors import PluginError


@attrs.define
class Registry:
    """A name -> object table for one kind of extension (runners, transports, ...)."""

    kind: str
    entries: dict[str, Any] = attrs.field(factory=dict)
    owners: dict[str, str] = attrs.field(factory=dict)
    # hook implementation code -> plugin name, set by the plugin manager before it calls the hook
    impl_owners: dict = attrs.field(factory=dict)

    def add(self, name: str, obj: Any, *, replace: bool = False) -> None:
        """Register ``obj`` under ``name``; a second registration of a name needs ``replace=True``."""
        owner = self.calling_plugin()
        if name in self.entries and not replace:
            raise PluginError(
                f"{self.kind} {name!r} registered twice (by {self.owners[name]} and {owner}); "
                "pass replace=True to override on purpose"
            )
        self.entries[name] = obj
        self.owners[name] = owner

    def calling_plugin(self) -> str:
        """The plugin whose hook implementation is running (found on the call stack), or "?"."""
        f = sys._getframe(1)
        while f is not None:
            owner = self.impl_owners.get(f.f_code)
            if owner is not None:
                return owner
            f = f.f_back
        return "?"

    def get(self, name: str) -> Any:
        try:
            return self.entries[name]
        except KeyError:
            raise PluginError(f"unknown {self.kind} {name!r}; known: {sorted(map(str, self.entries))}") from None

    def names(self) -> list[str]:
        return sorted(self.entries, key=str)

    def __contains__(self, name: str) -> bool:
        return name in self.entries
