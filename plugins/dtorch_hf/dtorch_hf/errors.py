"""The plugin's errors: dtorch_core's typed errors, narrowed to what went wrong here."""

from __future__ import annotations

from dtorch_core.errors import ConfigError, PluginError


class UnsupportedMeshDimError(ConfigError):
    """The mesh has a dim (by name) that the model's family cannot parallelize over."""


class UnknownModelError(PluginError):
    """No registered model family serves the model's class."""
