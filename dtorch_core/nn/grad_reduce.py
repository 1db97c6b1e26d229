"""Reduce a data-parallel model's gradients together, once backward has made them all.

Gradients of parameters replicated over a dp dim come out of backward as Partial sums over it.
Left alone they are still right: the optimizer's first read reduces each one (and the reduction
is kept for its other reads). Reducing them here instead sends one merged all-reduce for all of
them (``MergedAllReduce``: one exchange per dtype), as DDP's buckets do, instead of one per
parameter. A backward that leaves some parameter without a gradient skips the merge; the
optimizer then reduces what is left, one gradient at a time.
"""

from __future__ import annotations

import math

import attrs
import structlog
import torch.nn as nn

from ..planner.emit import CommEvent, merged_hints, note_comm
from ..ir.instructions import MergedAllReduce
from ..mesh import DeviceMesh
from ..placement import Partial, Replicate
from ..tensor import DTensor

log = structlog.get_logger(__name__)


@attrs.define
class GradientBucket:
    """Post-accumulate-grad hooks that reduce every Partial gradient over ``root_dim`` at once."""

    params: list
    root_dim: int
    ready: dict = attrs.field(factory=dict)  # id(param) -> param whose gradient is accumulated

    def arrived(self, param) -> None:
        self.ready[id(param)] = param
        if len(self.ready) == len(self.params):
            self.ready = {}
            self.reduce()

    def reduce(self) -> None:
        groups: dict = {}
        for p in self.params:
            g = p.grad
            if type(g) is not DTensor:
                continue
            placement = g._spec.placements[self.root_dim]
            if isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg", "max", "min"):
                groups.setdefault((g._spec.mesh, placement.reduce_op), []).append(p)
        for (mesh, op), params in groups.items():
            session = params[0].grad._handle.session
            partial = [p.grad for p in params]  # alive until the exchange is emitted: dropping one
            dsts = []  # earlier would let a background flush free it before the exchange reads it
            for p, g in zip(params, partial):
                placements = list(g._spec.placements)
                placements[self.root_dim] = Replicate()
                tid = session.new_tid()
                dsts.append(tid)
                p.grad = DTensor._make(g._spec.with_placements(tuple(placements)), g._view, tid, session)
            srcs = tuple(g._tid for g in partial)
            shapes, dtypes = merged_hints(session, [g._spec for g in partial])
            session.emit(MergedAllReduce(session.mesh_id(mesh), self.root_dim, op, srcs, tuple(dsts), shapes, dtypes))
            if session.comm_counters:
                note_comm(session, CommEvent("all_reduce", "data_parallel gradients",
                                             sum(math.prod(g.shape) * g.dtype.itemsize for g in partial)))
            del partial


def reduce_gradients_together(module: nn.Module, device_mesh: DeviceMesh) -> GradientBucket:
    """Register the hooks of a :class:`GradientBucket` on ``module``'s trainable parameters."""
    params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
    bucket = GradientBucket(params, device_mesh.dims_in_root[0])
    for p in params:
        p.register_post_accumulate_grad_hook(bucket.arrived)
    return bucket
