"""``_foreach_norm`` (``clip_grad_norm_(foreach=True)``) in a fixed handful of instructions.

Whatever the list length: Partial elements are reduced first (a norm is not linear), then one
worker call computes, per element, the local ``sum |x|^p`` (the local max ``|x|`` for ``inf``, the
local count of non-zeros for ``0``) into one float64 vector that is ``Partial("sum")``
(``Partial("max")``) over the whole mesh: a rank contributes an element only where it holds a
shard of it that no other rank along a replicated mesh dim also holds. One all-reduce per mesh dim
makes the vector Replicate and a second call takes the ``1/p`` power and splits it into the
outputs. Exact for uneven and empty shards (an empty shard contributes 0).
"""

from __future__ import annotations

import math

import attrs
import torch

from ..errors import OpError
from ..ir.instructions import Slot
from ..mesh import root_coordinate
from ..placement import Partial, Replicate, Shard
from ..planner.plans import kernel_plan
from ..redistribute import plan_redistribute
from ..spec import TensorSpec
from ..tensor import DTensor, view_for

INF = float("inf")
POWSUM = "dtorch::foreach_powsum"
ROOT = "dtorch::foreach_norm_root"


@attrs.define
class ForeachNormPlan:
    """The two worker calls (and the all-reduce between them) of one ``_foreach_norm`` key."""

    local: object  # DirectPlan: elements -> the Partial vector
    root: object  # DirectPlan: the vector, made Replicate -> the norms

    def run(self, session, tensors):
        vec = self.local.run(session, (), {}, list(tensors))
        return self.root.run(session, (), {}, [vec])


def foreach_norm(op, tensors, ord=2, dtype=None):
    """The norms of ``tensors`` (a list of DTensors on one mesh), or None where this path cannot
    serve the call (the caller then runs one norm per element)."""
    if not tensors or type(tensors) not in (list, tuple) or not all(type(t) is DTensor for t in tensors):
        return None
    if type(ord) not in (int, float):
        return None
    ord = float(ord)
    if not (ord == INF or ord == 0 or (math.isfinite(ord) and ord > 0)):
        return None  # negative orders (min-like) have no identity for empty shards
    if any(not t.dtype.is_floating_point for t in tensors):
        return None
    mesh = tensors[0]._spec.mesh
    if any(t._spec.mesh != mesh for t in tensors):
        return None
    session = tensors[0]._handle.session
    key = ("foreach_norm", op, tuple(t._spec for t in tensors), ord, dtype)
    plan = session.plans.get(key)
    if plan is None:
        plan = session.plans[key] = _build(session, op, tensors, ord, dtype, mesh)
    return plan.run(session, tensors)


def _build(session, op, tensors, ord, dtype, mesh) -> ForeachNormPlan:
    specs = [t._spec for t in tensors]
    metas = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in specs]
    try:
        out_dtypes = tuple(o.dtype for o in op(metas, ord, dtype))
    except Exception as exc:
        raise OpError(f"{op}: invalid arguments for {len(tensors)} tensors: {exc}") from exc
    views = {t._view for t in tensors}
    view = views.pop() if len(views) == 1 else None
    targets = [tuple(Replicate() if isinstance(p, Partial) else p for p in s.placements) for s in specs]
    moves = tuple(plan_redistribute(s.placements, tg) for s, tg in zip(specs, targets))
    acc = dtype if dtype is not None else (
        torch.float64 if any(s.dtype == torch.float64 for s in specs) else torch.float32)
    slots = [Slot(i) for i in range(len(tensors))]
    per_rank = {}
    for rank in mesh.ranks:
        coord = root_coordinate(mesh, rank)
        # an element counts once: on the ranks at coordinate 0 of every mesh dim it is replicated on
        mask = tuple(all(c == 0 for c, p in zip(coord, tg) if not isinstance(p, Shard)) for tg in targets)
        per_rank[rank] = ((slots,), {"ord": ord, "dtype": acc, "mask": None if all(mask) else mask})
    n, ndim = len(tensors), mesh.ndim
    vec_spec = TensorSpec(mesh, (Partial("max" if ord == INF else "sum"),) * ndim, (n,), (1,), torch.float64)
    local = kernel_plan(session, mesh, POWSUM, per_rank, op_name=str(op), pure=True, moves=moves,
                        out_specs=(vec_spec,), out_views=(view_for(vec_spec, view),),
                        rebuild=lambda outs: outs[0], simple=not any(moves))
    out_specs = tuple(TensorSpec(mesh, (Replicate(),) * ndim, (), (), d) for d in out_dtypes)
    root = kernel_plan(session, mesh, ROOT, {r: ((Slot(0),), {"ord": ord, "dtypes": out_dtypes}) for r in mesh.ranks},
                       op_name=str(op), pure=True,
                       moves=(plan_redistribute(vec_spec.placements, (Replicate(),) * ndim),),
                       out_specs=out_specs, out_views=tuple(view_for(s, view) for s in out_specs),
                       rebuild=list)
    return ForeachNormPlan(local, root)


# ---------------------------------------------------------------------------------------------
# worker kernels
# ---------------------------------------------------------------------------------------------
def foreach_powsum_kernel(tensors, *, ord, dtype, mask):
    """Per local shard ``sum |x|^ord`` (max ``|x|`` for inf, non-zeros for 0) as one float64 vector;
    zero where ``mask`` says another rank counts the element."""
    if ord == INF:  # torch refuses the inf norm of an empty tensor; its shard contributes 0
        tensors = [t if t.numel() else t.new_zeros(1) for t in tensors]
    norms = torch._foreach_norm(tensors, ord, dtype=dtype)
    vec = torch.stack(norms).to(torch.float64)
    if ord != INF and ord != 0:
        vec = vec.pow_(ord)
    if mask is not None:
        vec = vec.masked_fill_(~torch.tensor(mask, dtype=torch.bool, device=vec.device), 0)
    return vec


def foreach_norm_root_kernel(vec, *, ord, dtypes):
    """The reduced vector to one 0-d norm per element, in each element's result dtype."""
    if ord != INF and ord != 0:
        vec = vec.pow(1.0 / ord)
    columns = {}
    out = []
    for i, d in enumerate(dtypes):
        col = columns.get(d)
        if col is None:
            col = columns[d] = vec.to(d).unbind()
        out.append(col[i])
    return out


def register_kernels(registry) -> None:
    registry.add(POWSUM, foreach_powsum_kernel)
    registry.add(ROOT, foreach_norm_root_kernel)
