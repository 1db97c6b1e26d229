"""What a communicator that exchanges no headers learns from the instruction instead.

Between worker processes a collective's members must agree on every contribution's size before
the payloads move. The controller knows them all (the spec fixes every rank's local shape), so
runners that ask for it (``Runner.collective_hints``) get each rank's local source shape in the
instruction; see comm/dist.py for how they are used. Every runner gets the dtype: a rank whose
source failed must still group a merged all-reduce's sources by dtype as its peers do.
"""

from __future__ import annotations

import functools
import itertools

from ..ir.instructions import Collective
from ..spec import shard_region

COMMUNICATING = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})


@functools.lru_cache(maxsize=8192)
def local_shapes(shape: tuple, placements: tuple, mesh_shape: tuple) -> tuple:
    """The local shape on every rank of a mesh of ``mesh_shape``, in rank (C) order."""
    return tuple(
        tuple(length for _, length in shard_region(shape, placements, mesh_shape, coord))
        for coord in itertools.product(*(range(n) for n in mesh_shape))
    )


def emit_steps(session, mesh_id: int, tid: int, steps, spec) -> list:
    """Emit the Collectives of redistribution ``steps`` from tensor ``tid`` (of ``spec``, or
    None for a replicated plain tensor); the ids made, the last one holding the result."""
    made = []
    placements = spec.placements if spec is not None else None
    for step in steps:
        new = session.new_tid()
        shapes, dtype = (), None
        if spec is not None and step.kind in COMMUNICATING:
            dtype = spec.dtype
            if session.collective_hints:
                shapes = local_shapes(spec.shape, placements, spec.mesh.shape)
        session.emit(Collective(step.kind, mesh_id, step.mesh_dim, tid, new, step.dim, step.reduce_op, step.dim2,
                                shapes, dtype))
        made.append(new)
        tid = new
        placements = step.placements
    return made


def merged_hints(session, specs) -> tuple[tuple, tuple]:
    """``(shapes, dtypes)`` of a MergedAllReduce of tensors of ``specs``: per rank the local shape
    of every source (empty where the runner needs none), and every source's dtype (always: a
    rank whose sources failed must still group them by dtype as its peers do)."""
    dtypes = [s.dtype for s in specs]
    if not session.collective_hints:
        return (), tuple(dtypes)
    return merge_hints([local_shapes(s.shape, s.placements, s.mesh.shape) for s in specs], dtypes)


def merge_hints(per_source_shapes, dtypes) -> tuple[tuple, tuple]:
    """Per-source hints (each per rank) turned per rank (each per source)."""
    dtypes = tuple(dtypes) if all(d is not None for d in dtypes) else ()
    if not per_source_shapes or any(not s for s in per_source_shapes):
        return (), dtypes
    return tuple(zip(*per_source_shapes)), dtypes
