"""Data parallelism on a mesh dim: replicated parameters, batch-sharded inputs.

On a single controller nothing else is needed for correct values: gradients of replicated
parameters computed from batch-sharded activations come out as Partial sums over the
data-parallel dim, and the optimizer's in-place update would reduce them before touching the
parameters. For speed they are reduced together as soon as backward has made them all (one
merged all-reduce instead of one per parameter; see grad_reduce.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import PlacementError
from ..mesh import DeviceMesh
from ..placement import Replicate, Shard
from ..tensor import DTensor
from .grad_reduce import reduce_gradients_together
from .parallelize import replicate_rest


def data_parallel(module: nn.Module, device_mesh: DeviceMesh, *, batch_dim: int = 0,
                  reduce_together: bool = True) -> nn.Module:
    """Replicate ``module``'s parameters over ``device_mesh`` (e.g. ``mesh["dp"]``) and shard
    the batch dim of every tensor input over it.

    Parameters already distributed on the same root mesh (e.g. by ``parallelize_module`` on
    ``mesh["tp"]``) keep their placements: they are replicated over the dp dim already. With
    ``reduce_together`` the gradients are all-reduced over dp in one merged exchange when
    backward has made them all (the ``.grad`` tensors are then Replicate over dp).
    """
    check_data_parallel_mesh(module, device_mesh, "data_parallel")
    replicate_rest(module, device_mesh)
    shard_batch_inputs(module, device_mesh, batch_dim)
    if reduce_together:
        reduce_gradients_together(module, device_mesh)
    return module


def check_data_parallel_mesh(module: nn.Module, device_mesh: DeviceMesh, what: str) -> None:
    """Raise unless ``device_mesh`` is 1-D and every distributed parameter of ``module`` lives on
    its root mesh, replicated over it."""
    if device_mesh.ndim != 1:
        raise PlacementError(f"{what} needs a 1-D mesh (e.g. mesh['dp']), got {device_mesh!r}")
    for p in module.parameters():
        if isinstance(p, DTensor) and p._spec.mesh != device_mesh.root:
            raise PlacementError(
                f"a parameter lives on {p.device_mesh!r}, not on the root of {device_mesh!r}; "
                "parallelize the model on a sub-mesh of the same mesh"
            )
        if isinstance(p, DTensor) and not isinstance(p._spec.placements[device_mesh.dims_in_root[0]], Replicate):
            raise PlacementError(f"a parameter is {p.placements} on the data-parallel dim; it must be Replicate")


def shard_batch_inputs(module: nn.Module, device_mesh: DeviceMesh, batch_dim: int = 0):
    """Shard the batch dim of every tensor positional input of ``module`` over the 1-D
    ``device_mesh`` (a forward pre-hook; a plain tensor is distributed, a DTensor redistributed).
    Returns the hook's handle."""
    dim = device_mesh.dims_in_root[0]

    def shard_batch(_module, args):
        return tuple(_shard(a, device_mesh, dim, batch_dim) for a in args)

    return module.register_forward_pre_hook(shard_batch)


def _shard(x, mesh: DeviceMesh, root_dim: int, batch_dim: int):
    from ..api import distribute_tensor

    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        return distribute_tensor(x, mesh, [Shard(batch_dim)])
    placements = list(x._spec.placements)
    if placements[root_dim] == Shard(batch_dim % x.ndim):
        return x
    placements[root_dim] = Shard(batch_dim)
    return x.redistribute(x._spec.mesh, placements)
