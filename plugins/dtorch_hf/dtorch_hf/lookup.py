"""Finding the registered family that serves a model (the ``model_families`` registry)."""

from __future__ import annotations

import torch.nn as nn

from dtorch_core.plugins import get_plugins

from .errors import UnknownModelError
from .family import ModelFamily


def registered_families() -> dict[str, ModelFamily]:
    """Every registered family, by name (builtin ones and those of installed plugins)."""
    # entries keep registration order (builtins, then plugins in entry-point order)
    return dict(get_plugins().registry("model_families").entries)


def family_for(model: nn.Module) -> ModelFamily:
    """The family serving ``model``'s class; a later registration wins (plugins after builtins)."""
    found = [f for f in registered_families().values() if isinstance(f, ModelFamily) and f.serves(model)]
    if not found:
        known = {name: list(f.model_classes) for name, f in registered_families().items() if isinstance(f, ModelFamily)}
        raise UnknownModelError(
            f"no dtorch model family serves {type(model).__name__}; registered families: {known}. "
            "Pass a supported model, or register a family (dtorch_register_model_families, "
            "see the dtorch_hf README)"
        )
    return found[-1]
