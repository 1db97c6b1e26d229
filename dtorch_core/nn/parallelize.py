"""``parallelize_module``: apply parallel styles to sub-modules chosen by glob patterns."""

from __future__ import annotations

import fnmatch

import torch.nn as nn

from ..errors import PlacementError
from ..mesh import DeviceMesh
from ..placement import Replicate
from ..tensor import DTensor
from .styles import ParallelStyle, distribute_parameter


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan) -> nn.Module:
    """Apply ``parallelize_plan`` (a style, or ``{glob pattern: style}``) to ``module``.

    Patterns match dotted sub-module names with ``fnmatch`` (``"blocks.*.attn.q"``); a pattern
    that matches nothing raises. Every parameter and buffer no style distributed is then placed
    as Replicate on the mesh, so the model is never left half on the controller.
    """
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.apply(module, device_mesh)
    else:
        named = dict(module.named_modules())
        for pattern, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise PlacementError(f"plan entry {pattern!r} is {style!r}, not a parallel style")
            hits = [name for name in named if name and fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise PlacementError(
                    f"parallelize plan pattern {pattern!r} matches no sub-module; names look like "
                    f"{[n for n in named if n][:5]}"
                )
            for name in hits:
                style.apply(named[name], device_mesh)
    replicate_rest(module, device_mesh)
    return module


def replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """Distribute every parameter and buffer that is still a plain tensor as Replicate."""
    from ..api import distribute_tensor

    placements = [Replicate()] * mesh.ndim
    for sub in module.modules():
        for name, _ in list(sub.named_parameters(recurse=False)):
            distribute_parameter(sub, name, mesh, placements)
        for name, buf in list(sub.named_buffers(recurse=False)):
            if buf is not None and not isinstance(buf, DTensor):
                sub.register_buffer(name, distribute_tensor(buf, mesh, placements),
                                    persistent=name not in sub._non_persistent_buffers_set)
