"""Region arithmetic for checkpoints: who writes which part of a tensor, and which saved pieces a
destination shard needs.

A region is ``((offset, length), ...)`` per tensor dim, the form ``TensorSpec.region`` returns.
"""

from __future__ import annotations

import math

from ..mesh import DeviceMesh, root_coordinate
from ..spec import TensorSpec

Region = tuple  # ((offset, length), ...) per tensor dim


def numel(region: Region) -> int:
    return math.prod(n for _, n in region)


def assign_writers(specs: list[TensorSpec], mesh: DeviceMesh, itemsizes: list[int]) -> list[dict]:
    """Per tensor: ``{rank: region}`` with exactly one rank for each distinct non-empty region.

    Replicas hold the same region; of them the rank with the fewest bytes assigned so far writes
    it, so replicated tensors spread over the ranks instead of all landing on the first one.
    """
    assigned = {r: 0 for r in mesh.ranks}
    coords = {r: root_coordinate(mesh, r) for r in mesh.ranks}
    out = []
    for spec, itemsize in zip(specs, itemsizes):
        holders: dict = {}
        for rank in mesh.ranks:
            region = spec.region(coords[rank])
            if numel(region):
                holders.setdefault(region, []).append(rank)
        writers = {}
        for region, ranks in holders.items():
            rank = min(ranks, key=lambda r: (assigned[r], r))
            assigned[rank] += numel(region) * itemsize
            writers[rank] = region
        out.append(writers)
    return out


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions of one tensor, or None if they do not overlap (or it is empty)."""
    out = []
    for (ao, an), (bo, bn) in zip(a, b):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def relative(region: Region, within: Region) -> tuple:
    """``region`` as ``(start, stop)`` per dim, relative to the start of ``within``."""
    return tuple((o - wo, o - wo + n) for (o, n), (wo, _) in zip(region, within))


def reads_for(dest: Region, pieces) -> list[tuple]:
    """``(piece, src, dst)`` for every saved piece that overlaps ``dest``: ``src`` slices the
    piece, ``dst`` the destination shard (both ``((start, stop), ...)``)."""
    out = []
    for piece in pieces:
        overlap = intersect(piece.region, dest)
        if overlap is not None:
            out.append((piece, relative(overlap, piece.region), relative(overlap, dest)))
    return out


def as_slices(bounds) -> tuple:
    return tuple(slice(a, b) for a, b in bounds)
