"""Laying a model's inputs out over named mesh dims where they enter it: the batch over "dp"
and "cfg", the sequence over "sp"."""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

import dtorch_core as dt
from dtorch_core.mesh import DeviceMesh
from dtorch_core.placement import Replicate, Shard


def lay_out(value, mesh: DeviceMesh, wanted: dict):
    """``value`` with each mesh dim ``d`` of ``wanted`` laid out as ``wanted[d]``.

    A plain tensor is distributed (Replicate on the other dims). A DTensor on ``mesh`` (a
    pipeline's latents after the first step, an encoder output during generate) changes only
    the dims where it is Replicate: that is a local slice on each worker, no communication; a
    dim it already shards otherwise stays as it is (the values are the same either way).
    Anything else (0-d tensors, non-tensors, DTensors of another mesh) passes unchanged."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    if not isinstance(value, dt.DTensor):
        placements = [Replicate()] * mesh.ndim
        for d, p in wanted.items():
            placements[d] = p
        return dt.distribute_tensor(value, mesh, placements)
    if value.device_mesh != mesh:
        return value
    placements = list(value.placements)
    changed = False
    for d, p in wanted.items():
        if placements[d] == Replicate() and p != Replicate():
            placements[d] = p
            changed = True
    return value.redistribute(mesh, placements) if changed else value


def as_given(number: float):
    """A float argument of an op back as diffusers' modules hold it: an int where it is whole."""
    return int(number) if float(number).is_integer() else number


def one_op_forward(original, weight, ndim: int, op):
    """A module forward of one ``ndim``-D tensor input that runs ``op(x)`` (one op on the
    workers) while the model's parameter ``weight()`` is a DTensor: a plain ``x`` (a pipeline's
    ids or timesteps) is distributed first, replicated on that parameter's mesh, so that what the
    op makes stays on the workers. Otherwise (a plain model, another rank of input, an input that
    needs gradients) ``original(x)``, diffusers' own forward."""

    def forward(x):
        param = weight()
        if not isinstance(param, dt.DTensor) or x.ndim != ndim or x.requires_grad:
            return original(x)
        if not isinstance(x, dt.DTensor):
            mesh = param.device_mesh
            x = dt.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
        return op(x)

    return forward


def split_batch_on_entry(model: nn.Module, mesh: DeviceMesh, dims: list[int], patterns, kwargs_names) -> list[str]:
    """Install hooks on the sub-modules matching ``patterns`` ("" is the model itself) that lay
    their ``kwargs_names`` inputs (and first positional input) out as Shard(0) on the mesh dims
    ``dims`` ("dp", "cfg"). Masks stay plain: transformers builds attention masks from them on
    the controller, and a plain tensor meeting a sharded one is taken as replicated. Returns the
    hooked names."""
    names = set(kwargs_names)
    wanted = {d: Shard(0) for d in dims}

    def hook(module, args, kwargs):
        if args:
            args = (lay_out(args[0], mesh, wanted),) + tuple(args[1:])
        kwargs = {k: (lay_out(v, mesh, wanted) if k in names else v) for k, v in kwargs.items()}
        return args, kwargs

    hooked = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            module.register_forward_pre_hook(hook, with_kwargs=True)
            hooked.append(name)
    return hooked
