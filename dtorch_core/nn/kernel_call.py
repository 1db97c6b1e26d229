"""Run a named worker kernel on the local shards of distributed tensors, in place.

For module-level machinery (``materialize``, ``fully_shard``) that needs workers to do something
no torch op expresses. The call is an ordinary kernel plan (``planner.plans.kernel_plan``): a
``DefinePlan`` whose target is the kernel (with per-rank arguments where ranks differ) and a
``DirectPlan`` that emits one ``Call`` with the tensors' ids as inputs and no outputs.
"""

from __future__ import annotations

from typing import Callable

from ..errors import MeshMismatchError
from ..ir.instructions import Slot
from ..mesh import root_coordinate
from ..planner.plans import kernel_plan
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
    for x in inputs:
        if type(x) is not DTensor:
            raise TypeError(f"{target}: expected DTensors, got {type(x).__name__}")
    session = inputs[0]._handle.session
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
        # not pure: the kernel writes its inputs, so a captured step must keep it
        plan = kernel_plan(session, mesh, target, {r: (slots, {**kwargs, **e}) for r, e in extras.items()},
                           op_name=op_name or target, pure=False, n_inputs=len(inputs),
                           out_specs=tuple(inputs[i]._spec for i in writes),
                           out_views=tuple(inputs[i]._view for i in writes), out_alias=tuple(writes),
                           writes=tuple(writes))
        if key is not None:
            session.plans[key] = plan
    plan.run(session, (), {}, list(inputs))
