"""Splitting the batch over the "dp" mesh dim where a model's inputs enter it."""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

import dtorch_core as dt
from dtorch_core.mesh import DeviceMesh
from dtorch_core.placement import Replicate, Shard


def _split(value, mesh: DeviceMesh, dim: int):
    # only plain tensors: a DTensor is already laid out (an encoder output during generate)
    if not isinstance(value, torch.Tensor) or isinstance(value, dt.DTensor) or value.ndim == 0:
        return value
    placements = [Replicate()] * mesh.ndim
    placements[dim] = Shard(0)
    return dt.distribute_tensor(value, mesh, placements)


def split_batch_on_entry(model: nn.Module, mesh: DeviceMesh, dim: int, patterns, kwargs_names) -> list[str]:
    """Install hooks on the sub-modules matching ``patterns`` ("" is the model itself) that lay
    their ``kwargs_names`` inputs (and first positional input) out as Shard(0) on mesh dim
    ``dim``. Masks stay plain: transformers builds attention masks from them on the controller,
    and a plain tensor meeting a sharded one is taken as replicated. Returns the hooked names."""
    names = set(kwargs_names)

    def hook(module, args, kwargs):
        if args:
            args = (_split(args[0], mesh, dim),) + tuple(args[1:])
        kwargs = {k: (_split(v, mesh, dim) if k in names else v) for k, v in kwargs.items()}
        return args, kwargs

    hooked = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            module.register_forward_pre_hook(hook, with_kwargs=True)
            hooked.append(name)
    return hooked
