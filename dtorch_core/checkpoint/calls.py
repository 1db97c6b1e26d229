"""Controller side of the checkpoint kernels: one Call per mesh with per-rank arguments.

It goes through the ordinary dispatch path, as ``dispatch.plan_factory`` does: a ``DefinePlan``
naming the kernel, with the arguments that differ per rank in ``rank_args``, run as a
``DirectPlan`` whose one output is a small status tensor per rank. Fetching that status waits
for the kernel on every rank and turns a kernel failure into an error naming the rank and file.
"""

from __future__ import annotations

import re

import torch

from ..planner.dispatch import DirectPlan
from ..errors import CheckpointIOError, WorkerError
from ..ir.instructions import DefinePlan
from ..mesh import DeviceMesh
from ..placement import Shard
from ..controller.session import current_session
from ..spec import TensorSpec
from .kernels import FILE_ERROR_PREFIX

_FILE_IN_MESSAGE = re.compile(re.escape(FILE_ERROR_PREFIX) + r"(.+?): (?:write|read) failed")


def _status_spec(mesh: DeviceMesh) -> TensorSpec:
    # one row [bytes, count] per rank: the rows nest along dim 0 over every mesh dim, in rank order
    return TensorSpec(mesh, (Shard(0),) * mesh.ndim, (mesh.size(), 2), (2, 1), torch.int64)


def run_kernel(mesh: DeviceMesh, target: str, inputs: list, per_rank: dict, what: str, *,
               writes_inputs: bool = False) -> dict:
    """Run kernel ``target`` once on every rank of ``mesh`` (a root mesh) with ``inputs`` (DTensors
    on it) and ``per_rank[rank] = (args, kwargs)``; wait for it and return ``{rank: (bytes, count)}``.

    ``writes_inputs``: the kernel writes its inputs in place (dispatch then refuses views whose
    writes would not reach their base, as for any in-place op). Raises CheckpointIOError naming
    the rank and the file when the kernel failed on a worker.
    """
    session = current_session()
    mesh_id = session.mesh_id(mesh)
    base = per_rank[mesh.ranks[0]]
    rank_args = {r: v for r, v in per_rank.items() if r != mesh.ranks[0] and v != base}
    plan_id = session.new_plan_id()
    # not pure: the kernels write files or their inputs, so a captured step must keep them
    session.define_plan(DefinePlan(plan_id, mesh_id, target, base[0], base[1], rank_args or None, what, False),
                        pure=False)
    plan = DirectPlan(
        plan_id=plan_id,
        mesh=mesh,
        moves=tuple(() for _ in inputs),
        out_specs=(_status_spec(mesh),),
        out_views=(mesh,),
        out_alias=(None,),
        rebuild=lambda outs: outs[0],
        seeded=False,
        mesh_id=mesh_id,
        writes=tuple(range(len(inputs))) if writes_inputs else (),
        op_name=what,
    )
    status = plan.run(session, (), {}, list(inputs))
    try:
        shards = session.fetch(status._tid, mesh.ranks)
    except WorkerError as exc:
        match = _FILE_IN_MESSAGE.search(str(exc))
        raise CheckpointIOError(
            f"{what} failed on rank {exc.rank}: {exc}", rank=exc.rank, file=match.group(1) if match else None
        ) from exc
    return {r: (int(t[0, 0]), int(t[0, 1])) for r, t in shards.items()}
