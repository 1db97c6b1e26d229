"""Placements (how a tensor lies along one mesh dim) and shard extents.

Uneven shards follow ``torch.chunk``: chunk size ``ceil(n / k)``, trailing shards may be
smaller or empty.
"""

from __future__ import annotations

import attrs

from .errors import PlacementError

REDUCE_OPS = ("sum", "avg", "max", "min")


@attrs.frozen
class Shard:
    """The tensor is split along ``dim`` across the mesh dim."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@attrs.frozen
class Replicate:
    """Every device of the mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@attrs.frozen
class Partial:
    """Every device holds a partial value; the true value is their reduction by ``reduce_op``."""

    reduce_op: str = attrs.field(default="sum")

    @reduce_op.validator
    def _check(self, _attr, value):
        if value not in REDUCE_OPS:
            raise PlacementError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {value!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


Placement = Shard | Replicate | Partial


@attrs.frozen
class ShardExtent:
    """Where one shard lies along a tensor dim: ``[offset, offset + length)``."""

    offset: int
    length: int


def chunk_extent(size: int, parts: int, index: int) -> ShardExtent:
    """Extent of chunk ``index`` when ``size`` elements are split as ``torch.chunk`` does."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return ShardExtent(start, max(0, min(start + step, size) - start))


def normalize_placements(placements, ndim: int, mesh_ndim: int) -> tuple:
    """Validate placements for a tensor of ``ndim`` dims on a mesh of ``mesh_ndim`` dims."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"got {len(placements)} placements {placements} for a {mesh_ndim}-D mesh; "
            "give exactly one placement per mesh dim"
        )
    out = []
    for p in placements:
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise PlacementError(f"{p!r} is out of range for a tensor with {ndim} dims")
            out.append(Shard(d))
        elif isinstance(p, (Replicate, Partial)):
            out.append(p)
        else:
            raise PlacementError(f"{p!r} is not a placement; use Shard(dim), Replicate() or Partial(op)")
    return tuple(out)
