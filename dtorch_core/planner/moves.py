"""Data movement the controller issues outside an op's plan: redistributions and reads.

``issue_redistribute`` emits the collectives and returns the new handle at once (the workers
run them in the background); the reads wait for the workers.
"""

from __future__ import annotations

import torch

from ..errors import PlacementError
from ..ir.instructions import Collective
from ..mesh import DeviceMesh, root_coordinate
from ..placement import Partial, Replicate
from ..redistribute import plan_redistribute
from ..tensor import DTensor, view_for
from .emit import emit_shift, emit_steps


# (spec, placements) -> (steps, new spec): a program redistributes the same few tensors' kinds
# over and over, and planning costs more than the lookup
_MOVES: dict = {}
_MOVES_LIMIT = 4096


def planned_move(spec, placements: tuple) -> tuple:
    """The redistribution steps of a tensor of ``spec`` to ``placements``, and its new spec."""
    key = (spec, placements)
    hit = _MOVES.get(key)
    if hit is None:
        if len(_MOVES) >= _MOVES_LIMIT:
            _MOVES.clear()
        hit = _MOVES[key] = (plan_redistribute(spec.placements, placements), spec.with_placements(placements))
    return hit


def issue_redistribute(x: DTensor, placements: tuple, view: DeviceMesh | None = None,
                       op_name: str = "redistribute") -> DTensor:
    """``x`` with ``placements`` (on its root mesh): the collectives are issued, not waited for.
    No autograd: ``DTensor.redistribute`` is the differentiable one."""
    session = x._handle.session
    spec = x._spec
    steps, new_spec = planned_move(spec, tuple(placements))
    if not steps:
        tid = session.new_tid()
        session.emit(Collective("alias", session.mesh_id(spec.mesh), 0, x._tid, tid))
        return DTensor._make(new_spec, view or view_for(new_spec, x._view), tid, session)
    temps = emit_steps(session, session.mesh_id(spec.mesh), x._tid, steps, spec, op_name)
    session.release_many(temps[:-1])
    return DTensor._make(new_spec, view or view_for(new_spec, x._view), temps[-1], session)


def issue_shift(x: DTensor, mesh_dim: int, offset: int, spec=None, op_name: str = "shift") -> DTensor:
    """A handle of ``spec`` (``x``'s own if omitted) whose local tensors are ``x``'s shifted
    along ``mesh_dim``: each member of a group holds member ``index + offset``'s local tensor of
    ``x``. The caller's ``spec`` says what that means globally (a roll by whole shards keeps the
    placements). No autograd: ``aten.roll``'s decomposition is the differentiable way in."""
    session = x._handle.session
    spec = x._spec if spec is None else spec
    tid = emit_shift(session, session.mesh_id(x._spec.mesh), x._tid, x._spec, mesh_dim, offset, op_name)
    return DTensor._make(spec, view_for(spec, x._view), tid, session)


def without_partial(placements) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def fetch_full(x: DTensor) -> torch.Tensor:
    """The global value of ``x`` on the controller (a sync point, no autograd)."""
    session = x._handle.session
    spec = x._spec
    if spec.has_partial():
        x = issue_redistribute(x, without_partial(spec.placements), op_name="full_tensor")
        spec = x._spec
    root = spec.mesh
    picks = {}
    for rank in root.ranks:
        picks.setdefault(spec.region(root_coordinate(root, rank)), rank)
    shards = session.fetch(x._tid, picks.values())
    out = torch.empty(spec.shape, dtype=spec.dtype)
    for region, rank in picks.items():
        out[tuple(slice(off, off + n) for off, n in region)] = shards[rank]
    return out


def local_shard(x: DTensor, rank: int | None = None) -> torch.Tensor:
    """The shard ``rank`` holds (the mesh's first rank if omitted), copied to the controller."""
    root = x._spec.mesh
    rank = root.ranks[0] if rank is None else rank
    if rank not in root.ranks:
        raise PlacementError(f"rank {rank} is not on the mesh {root!r}")
    return x._handle.session.fetch(x._tid, (rank,))[rank].detach().clone()


def local_shards(x: DTensor) -> dict:
    """Every rank's shard of ``x``, keyed by rank, copied to the controller."""
    return {r: t.detach().clone() for r, t in x._handle.session.fetch(x._tid, x._spec.mesh.ranks).items()}
