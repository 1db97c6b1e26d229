"""``fully_shard``: FSDP-style parameters, sharded over a data-parallel mesh dim.

Every parameter is stored ``Shard(dim)`` on the dp dim (its placements on other dims, e.g. tp
from ``parallelize_module``, stay) and the batch dim of the model's inputs is sharded over dp.
For compute, each module that owns parameters gathers them to Replicate on dp just before its
forward and drops them after it:

- A forward pre-hook replaces each entry of ``module._parameters`` by
  ``param.redistribute(dp, [Replicate()])`` (an all-gather) and a forward hook (``always_call``,
  so an exception restores too) puts the stored parameter back. ``module.weight`` inside the
  forward is therefore the gathered tensor, and everywhere else (``parameters()``,
  ``state_dict()``, the optimizer) the sharded one.
- This is safe with autograd because autograd follows tensors, not module attributes: the
  gathered tensor is a non-leaf made by the differentiable ``redistribute`` from the stored
  parameter (the leaf), so the gradient of everything computed with it flows back through
  ``redistribute``'s backward, which turns the Partial-over-dp gradient of the batch-sharded
  compute into a reduce-scatter: ``.grad`` of the stored parameter is Shard(dim) on dp, and a
  plain ``torch.optim`` optimizer updates only shards. Swapping the dict entry back does not
  touch the graph already recorded.
- Autograd keeps the gathered tensors (and views of them, like a Linear's transposed weight)
  for the backward. After the forward their memory on the workers is released (kernel
  ``dtorch::release_storage``; the handles stay valid) and a hook on the module's outputs
  gathers the values again into the same memory when the backward reaches the module
  (``dtorch::refill_storage``), as torch's FSDP does by resizing storage. So at any time a
  device holds its shards plus the gathered parameters of the modules running now. Without
  grad (``torch.no_grad()``, evaluation) the gathered tensors are simply dropped.

A module's parameters are gathered while it (and its children) run, so a parent that owns
parameters itself keeps them gathered during its children's forwards. Outputs that are views of
a gathered parameter (a module returning ``self.weight[...]``) keep its memory.
"""

from __future__ import annotations

import weakref

import attrs
import structlog
import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..planner.moves import issue_redistribute
from ..mesh import DeviceMesh
from ..placement import Replicate, Shard
from ..tensor import DTensor
from .data_parallel import check_data_parallel_mesh, shard_batch_inputs
from .kernel_call import call_kernel
from .parallelize import replicate_rest

log = structlog.get_logger(__name__)


def fully_shard(module: nn.Module, device_mesh: DeviceMesh, *, dim: int = 0, batch_dim: int = 0) -> nn.Module:
    """Shard ``module``'s parameters over the 1-D ``device_mesh`` (e.g. ``mesh["dp"]``) along
    tensor dim ``dim`` (uneven shards follow ``torch.chunk``), shard the batch dim of its inputs
    over it, and gather each sub-module's parameters only for its forward (see the module
    docstring). Buffers are replicated. Parameters already distributed on the same root mesh
    (``parallelize_module`` on ``mesh["tp"]``) keep their other placements; plain ones go
    straight to their shards. 0-d parameters stay replicated. Tied parameters stay one
    parameter. Create the optimizer afterwards: it must see the sharded parameters.
    """
    check_data_parallel_mesh(module, device_mesh, "fully_shard")
    root_dim = device_mesh.dims_in_root[0]
    sharded: dict = {}  # id(parameter) -> its sharded Parameter: tied parameters stay one
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            new = sharded.get(id(p))
            if new is None:
                new = sharded[id(p)] = _shard_parameter(p, device_mesh, dim)
            sub._parameters[name] = new
    replicate_rest(module, device_mesh)  # the buffers
    for sub in module.modules():
        names = tuple(n for n, p in sub._parameters.items()
                      if p is not None and isinstance(p._spec.placements[root_dim], Shard))
        if names:
            gather = _GatherForForward(names, device_mesh)
            sub.register_forward_pre_hook(gather.before)
            sub.register_forward_hook(gather.after, always_call=True)
    shard_batch_inputs(module, device_mesh, batch_dim)
    log.debug("fully sharded", parameters=len(sharded), mesh=device_mesh)
    return module


def _shard_parameter(p: torch.Tensor, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    from ..api import distribute_tensor

    shard = Shard(dim % p.ndim) if p.ndim else Replicate()  # a 0-d parameter stays replicated
    if not isinstance(p, DTensor):
        # straight to the shards: a plain parameter is never replicated on the workers first
        return nn.Parameter(distribute_tensor(p.detach(), mesh, [shard]), requires_grad=p.requires_grad)
    if not p.ndim:
        return p
    placements = list(p._spec.placements)
    placements[mesh.dims_in_root[0]] = shard
    # the old replicated parameter is dropped as soon as the module holds the shard
    return nn.Parameter(issue_redistribute(p.detach(), tuple(placements)), requires_grad=p.requires_grad)


@attrs.define
class _GatherForForward:
    """The hooks of one module: gather its parameters before its forward, release them after."""

    names: tuple
    mesh: DeviceMesh
    calls: list = attrs.field(factory=list)  # (stored, gathered) per forward in progress

    def before(self, module, args):
        stored, gathered = {}, {}
        for name in self.names:
            p = module._parameters[name]
            g = p.redistribute(self.mesh, [Replicate()])
            stored[name], gathered[name] = p, g
            module._parameters[name] = g
        self.calls.append((stored, gathered))

    def after(self, module, args, output):
        stored, gathered = self.calls.pop()
        module._parameters.update(stored)
        if not torch.is_grad_enabled():
            return None
        outputs = _tensors(output)
        needs_grad = [o for o in outputs if o.requires_grad]
        if not needs_grad:
            return None
        kept = []
        for name, g in gathered.items():
            if not g.requires_grad or any(_views(o, g) for o in outputs):
                continue  # not in the graph, or an output views it: its memory stays
            call_kernel("dtorch::release_storage", [g, stored[name]], writes=(0,), op_name="fully_shard release")
            kept.append((weakref.ref(g), stored[name]))
        if kept:
            torch.autograd.graph.register_multi_grad_hook(needs_grad, _Refill(kept), mode="any")
        return None


@attrs.define
class _Refill:
    """Called when the backward reaches a module's outputs: gather its parameters again into
    the released memory of the tensors autograd kept."""

    kept: list

    def __call__(self, grad) -> None:
        for ref, stored in self.kept:
            g = ref()
            if g is None:  # autograd did not keep it: nothing to refill
                continue
            full = issue_redistribute(stored, g._spec.placements)
            call_kernel("dtorch::refill_storage", [g, full], writes=(0,), op_name="fully_shard refill")


def _views(t: torch.Tensor, g: torch.Tensor) -> bool:
    while t is not None:
        if t is g:
            return True
        t = t._base
    return False


def _tensors(x) -> list:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
