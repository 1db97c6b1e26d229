"""Tensors made directly on the workers: each rank creates only its own shard."""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh, root_coordinate
from ..placement import Partial, Replicate
from ..spec import TensorSpec, contiguous_stride
from ..tensor import DTensor, root_placements
from .plans import kernel_plan


def factory(session, kind: str, shape: tuple, device_mesh: DeviceMesh, placements, dtype,
            fill=None, requires_grad: bool = False) -> DTensor:
    """A new tensor of ``kind`` (zeros, ones, empty, full, rand, randn, arange) of global
    ``shape`` on ``device_mesh``; ``dtype`` None infers it as torch does; ``fill`` is full's value
    or arange's (start, step)."""
    if dtype is None:
        if kind == "full":
            dtype = torch.full((), fill).dtype  # torch's own inference: int64, bool, float...
        elif kind == "arange":
            dtype = torch.arange(fill[0], fill[0] + fill[1], fill[1]).dtype
        else:
            dtype = torch.get_default_dtype()
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    full = root_placements(device_mesh, placements, len(shape))
    spec = TensorSpec(device_mesh.root, full, shape, contiguous_stride(shape), dtype)
    out = _issue(session, kind, spec, device_mesh, fill)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _issue(session, kind: str, spec: TensorSpec, view: DeviceMesh, fill) -> DTensor:
    key = ("factory", kind, spec, view, fill)
    plan = session.plans.get(key)
    if plan is None:
        mesh = spec.mesh
        per_rank = {}
        for rank in mesh.ranks:
            coord = root_coordinate(mesh, rank)
            kw = {"kind": kind, "shape": spec.shape, "region": spec.region(coord), "dtype": spec.dtype,
                  "fill": fill, "device": mesh.device_type}
            if any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0
                   for m, p in enumerate(spec.placements)):
                kw["kind"] = "zeros"  # a Partial("sum") value lives on one rank of the dim
            per_rank[rank] = ((), kw)
        plan = session.plans[key] = kernel_plan(
            session, mesh, "dtorch::factory", per_rank, op_name=f"dtorch.{kind}", pure=True,
            seeded=kind in ("rand", "randn"), out_specs=(spec,), out_views=(view,), rebuild=lambda outs: outs[0])
    return plan.run(session, (), {}, [])
