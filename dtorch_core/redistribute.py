"""Redistribution planning: the collective steps that turn one placement list into another.

Shards of one tensor dim nest in mesh-dim order, so steps that undo placements run from the last
mesh dim to the first and steps that create placements run from the first to the last. A mesh dim
whose placement stays the same is redone when an earlier mesh dim that shards the same tensor dim
changes (its chunks would no longer line up). A Shard -> Shard change on one mesh dim is an
all-to-all inside its groups where every other mesh dim sharding either tensor dim comes before
it and is not redone (Ulysses on ("tp", "sp"): [Shard(heads), Shard(seq)] <-> [Shard(heads),
Shard(heads)]): a group's members then hold the same outer chunk, so the all-to-all of their
local chunks is exact, uneven sizes included; otherwise it is gathered and chunked again. A
Partial -> Shard change is a reduce-scatter under the same condition (sequence parallel on
("sp", "tp"): [Shard(seq), Partial] -> [Shard(seq), Shard(seq)], a row-parallel output reduced
and scattered over "tp" within each "sp" chunk); otherwise it is reduced whole and chunked.
"""

from __future__ import annotations

import attrs

from .mesh import root_coordinate
from .placement import Partial, Replicate, Shard


@attrs.frozen
class Step:
    """One redistribution step on one mesh dim; ``placements`` is the state after it."""

    kind: str
    mesh_dim: int
    placements: tuple
    dim: int = 0
    reduce_op: str = "sum"
    dim2: int = 0


def plan_redistribute(src: tuple, dst: tuple) -> tuple[Step, ...]:
    """Steps from placements ``src`` to ``dst`` (same root mesh, one placement per mesh dim)."""
    if src == dst:
        return ()
    n = len(src)
    cur = list(src)
    redo = [src[i] != dst[i] for i in range(n)]
    for i in range(n):
        if not redo[i]:
            continue
        dims_i = {p.dim for p in (src[i], dst[i]) if isinstance(p, Shard)}
        for j in range(i + 1, n):
            if any(isinstance(p, Shard) and p.dim in dims_i for p in (src[j], dst[j])):
                redo[j] = True
        # a later Shard on any dim nested under an earlier changing Shard of the same dim
    steps: list[Step] = []

    def nested_in_fixed_outer(i, dims):
        # every other mesh dim sharding ``dims`` comes before i and stays as it is: the members of
        # an i-group (equal coordinates on every other mesh dim) hold one and the same outer chunk,
        # of one size however uneven, so the step runs on the local chunk as on a whole tensor
        return not any(
            isinstance(p, Shard) and p.dim in dims and (j > i or redo[j])
            for j in range(n) if j != i for p in (cur[j], dst[j])
        )

    for i in reversed(range(n)):
        if not redo[i]:
            continue
        s, d = cur[i], dst[i]
        if isinstance(s, Partial) and isinstance(d, Shard) and nested_in_fixed_outer(i, {d.dim}):
            cur[i] = d
            steps.append(Step("reduce_scatter", i, tuple(cur), dim=d.dim, reduce_op=s.reduce_op))
        elif (
            isinstance(s, Shard)
            and isinstance(d, Shard)
            and s.dim != d.dim
            and nested_in_fixed_outer(i, {s.dim, d.dim})
        ):
            cur[i] = d
            steps.append(Step("all_to_all", i, tuple(cur), dim=s.dim, dim2=d.dim))
        elif isinstance(s, Shard):
            cur[i] = Replicate()
            steps.append(Step("all_gather", i, tuple(cur), dim=s.dim))
        elif isinstance(s, Partial) and s != d:
            cur[i] = Replicate()
            steps.append(Step("all_reduce", i, tuple(cur), reduce_op=s.reduce_op))
    for i in range(n):
        if cur[i] == dst[i]:
            continue
        d = dst[i]
        if isinstance(d, Shard):
            cur[i] = d
            steps.append(Step("local_chunk", i, tuple(cur), dim=d.dim))
        elif isinstance(d, Partial):
            cur[i] = d
            steps.append(Step("to_partial", i, tuple(cur), reduce_op=d.reduce_op))
    assert tuple(cur) == tuple(dst), (src, dst, cur)
    return tuple(steps)


def redistribute_cost(src, dst, nbytes: int) -> float:
    """Rough bytes moved to go from ``src`` to ``dst`` on one mesh dim."""
    if src == dst:
        return 0.0
    if isinstance(src, Replicate):
        return 0.01 * nbytes  # local chunk or zero-fill: no communication, a copy
    if isinstance(src, Shard):
        return float(nbytes)
    if isinstance(dst, Shard):
        return float(nbytes)  # reduce-scatter
    return 2.0 * nbytes  # all-reduce


def same_local_regions(src, dst) -> bool:
    """Whether every rank holds the same region of the tensor under spec ``src`` as under spec
    ``dst``, whose root meshes are two meshes of the same devices (neither spec Partial): then
    moving the tensor from one mesh to the other moves no data."""
    for rank in src.mesh.ranks:
        if src.region(root_coordinate(src.mesh, rank)) != dst.region(root_coordinate(dst.mesh, rank)):
            return False
    return True
