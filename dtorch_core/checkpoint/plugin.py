"""The builtin checkpoint plugin (``dtorch.checkpoint``): the workers' read and write kernels."""

from __future__ import annotations

from ..hookspecs import hookimpl
from . import kernels


@hookimpl
def dtorch_register_kernels(registry) -> None:
    kernels.register(registry)
