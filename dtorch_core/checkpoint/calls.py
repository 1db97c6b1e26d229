"""Controller side of the checkpoint kernels: one Call per mesh with per-rank arguments.

It is an ordinary kernel plan (``planner.plans.kernel_plan``): a ``DefinePlan`` naming the
kernel, with the arguments that differ per rank in ``rank_args``, run as a ``DirectPlan`` whose
one output is a small status tensor per rank. Fetching that status waits
for the kernel on every rank and turns a kernel failure into an error naming the rank and file.
"""

from __future__ import annotations

import re

import torch

from ..controller.session import current_session
from ..errors import CheckpointIOError, WorkerError
from ..mesh import DeviceMesh
from ..placement import Shard
from ..planner.plans import kernel_plan
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
    # not pure: the kernels write files or their inputs, so a captured step must keep them
    plan = kernel_plan(session, mesh, target, per_rank, op_name=what, pure=False, n_inputs=len(inputs),
                       out_specs=(_status_spec(mesh),), out_views=(mesh,), rebuild=lambda outs: outs[0],
                       writes=tuple(range(len(inputs))) if writes_inputs else ())
    status = plan.run(session, (), {}, list(inputs))
    try:
        shards = session.fetch(status._tid, mesh.ranks)
    except WorkerError as exc:
        match = _FILE_IN_MESSAGE.search(str(exc))
        raise CheckpointIOError(
            f"{what} failed on rank {exc.rank}: {exc}", rank=exc.rank, file=match.group(1) if match else None
        ) from exc
    return {r: (int(t[0, 0]), int(t[0, 1])) for r, t in shards.items()}
