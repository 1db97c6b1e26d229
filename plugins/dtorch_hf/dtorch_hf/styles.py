"""Applying core parallel styles along one named dim of an N-D mesh.

``dt.nn.ColwiseParallel``/``RowwiseParallel`` work on a 1-D mesh: given ``mesh["tp"]`` of a
("tp", "dp") mesh, their hooks redistribute activations on that view and so gather the batch
that "dp" split. Here the same styles are applied on the whole mesh, changing only the "tp"
entry of each placement, so every other dim's placement (the dp batch shard) passes through.
On a 1-D mesh the core style itself is applied.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import dtorch_core as dt
from dtorch_core.errors import PlacementError
from dtorch_core.mesh import DeviceMesh
from dtorch_core.nn.styles import ColwiseParallel, ParallelStyle, RowwiseParallel, distribute_parameter
from dtorch_core.placement import Replicate, Shard


def _on_dim(mesh: DeviceMesh, dim: int, placement) -> list:
    out = [Replicate()] * mesh.ndim
    out[dim] = placement
    return out


def _retarget(x, mesh: DeviceMesh, dim: int, placement):
    """``x`` with ``placement`` on mesh dim ``dim`` and its other dims' placements unchanged
    (a plain tensor holds the global value and is replicated on the other dims)."""
    if placement is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim % x.ndim)
    if not isinstance(x, dt.DTensor):
        return dt.distribute_tensor(x, mesh, _on_dim(mesh, dim, placement))
    if x.device_mesh != mesh:
        # a tensor made on another view of the devices: lay it out on this mesh from scratch
        return x.redistribute(mesh, _on_dim(mesh, dim, placement))
    wanted = list(x.placements)
    if wanted[dim] == placement:
        return x
    wanted[dim] = placement
    return x.redistribute(mesh, wanted)


def _first_input(mesh, dim, placement):
    def hook(module, args):
        if not args:
            return args
        return (_retarget(args[0], mesh, dim, placement),) + tuple(args[1:])
    return hook


def _output(mesh, dim, placement):
    def hook(module, args, out):
        if isinstance(out, tuple):
            return tuple(_retarget(o, mesh, dim, placement) for o in out)
        return _retarget(out, mesh, dim, placement)
    return hook


def apply_style(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh, dim_name: str) -> None:
    """Apply ``style`` to ``module`` along mesh dim ``dim_name`` of ``mesh``."""
    if mesh.ndim == 1 or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        style.apply(module, mesh[dim_name] if mesh.ndim > 1 else mesh)
        return
    if style.use_local_output:
        raise PlacementError(
            f"{type(style).__name__}(use_local_output=True) on a {mesh.ndim}-D mesh would hand "
            "out per-device pieces of a tensor that other dims also split; drop use_local_output"
        )
    dim = mesh.mesh_dim_names.index(dim_name)
    linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    if not (linear or embedding):
        raise PlacementError(f"{type(style).__name__} supports nn.Linear and nn.Embedding, not {type(module).__name__}")
    if isinstance(style, ColwiseParallel):
        weight, inputs, output = (Shard(0) if linear else Shard(1)), Replicate(), style.output_layouts
        distribute_parameter(module, "bias", mesh, _on_dim(mesh, dim, Shard(0)))
    else:
        weight, inputs, output = (Shard(1) if linear else Shard(0)), (Shard(-1) if linear else Replicate()), style.output_layouts
        distribute_parameter(module, "bias", mesh, _on_dim(mesh, dim, Replicate()))
    distribute_parameter(module, "weight", mesh, _on_dim(mesh, dim, weight))
    module.register_forward_pre_hook(_first_input(mesh, dim, inputs))
    if output is not None:
        module.register_forward_hook(_output(mesh, dim, output))
