"""Run a named worker kernel on the local shards of distributed tensors, in place.

For module-level machinery (``materialize``, ``fully_shard``) that needs workers to do something
no torch op expresses. The call goes through the dispatch machinery like ``plan_factory``: a
``DefinePlan`` whose target is the kernel (with per-rank arguments where ranks differ) and a
``DirectPlan`` that emits one ``Call`` with the tensors' ids as inputs and no outputs.
"""

from __future__ import annotations

from typing import Callable

from ..planner.dispatch import DirectPlan
from ..errors import MeshMismatchError
from ..ir.instructions import DefinePlan, Slot
from ..mesh import root_coordinate
from ..controller.session import current_session
from ..tensor import DTensor


def call_kernel(target: str, inputs: list, *, writes: tuple = (), kwargs: dict | None = None,
                rank_kwargs: Callable[[int, tuple], dict] | None = None, op_name: str | None = None,
                cache: bool = True) -> None:
    """Run kernel ``target`` on every rank as ``target(*local_shards, **kwargs)``.

    ``inputs`` are DTensors on one root mesh. The kernel writes the local shards of the inputs
    indexed by ``writes`` in place and returns them (one tensor, or a tuple in ``writes``
    order): they are the call's outputs, so a kernel that fails marks them failed and the next
    read of one raises ``WorkerError``. ``rank_kwargs(rank, coordinate)`` adds arguments that
    depend on the rank. With ``cache`` the plan is kept for the inputs' specs (only for calls
    without ``kwargs``/``rank_kwargs``).
    """
    session = current_session()
    for x in inputs:
        if type(x) is not DTensor:
            raise TypeError(f"{target}: expected DTensors, got {type(x).__name__}")
    meshes = {x._spec.mesh for x in inputs}
    if len(meshes) != 1:
        raise MeshMismatchError(f"{target}: the tensors live on {len(meshes)} different meshes; use one mesh")
    mesh = meshes.pop()
    kwargs = kwargs or {}
    key = None
    if cache and not kwargs and rank_kwargs is None:
        key = ("kernel", target, tuple(writes), tuple(x._spec for x in inputs))
    plan = session.plans.get(key) if key is not None else None
    if plan is None:
        slots = tuple(Slot(i) for i in range(len(inputs)))
        extras = {r: rank_kwargs(r, root_coordinate(mesh, r)) if rank_kwargs is not None else {} for r in mesh.ranks}
        first = extras[mesh.ranks[0]]
        # only the rank-dependent part is compared: kwargs may hold tensors
        rank_args = {r: (slots, {**kwargs, **e}) for r, e in extras.items() if e != first}
        base = (slots, {**kwargs, **first})
        plan_id = session.new_plan_id()
        mesh_id = session.mesh_id(mesh)
        define = DefinePlan(plan_id, mesh_id, target, base[0], base[1], rank_args or None, op_name or target, False)
        # not pure: the kernel writes its inputs, so a captured step must keep it
        session.define_plan(define, pure=False)
        n = len(inputs)
        plan = DirectPlan(plan_id=plan_id, mesh=mesh, moves=((),) * n,
                          out_specs=tuple(inputs[i]._spec for i in writes),
                          out_views=tuple(inputs[i]._view for i in writes), out_alias=tuple(writes),
                          rebuild=lambda outs: None, seeded=False, mesh_id=mesh_id, writes=tuple(writes),
                          op_name=op_name or target)
        if key is not None:
            session.plans[key] = plan
    plan.run(session, (), {}, list(inputs))

