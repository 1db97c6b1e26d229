"""Placements (how a tensor lies along one mesh dim) and shard extents.

Uneven shards follow ``torch.chunk``: chunk size ``ceil(n / k)``, trailing shards may be
smaller or empty.
"""

from __future__ import annotations

import sys

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
    for p in map(as_placement, placements):
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


# -- torch.distributed.tensor's placements ---------------------------------------------------
# Code written for DTensor passes torch's own Shard/Replicate/Partial; they are converted here,
# the one place placements pass through. torch's module is never imported for it (it costs most
# of a second): an object of one of its classes means the user imported it already.
TORCH_PLACEMENTS = "torch.distributed.tensor.placement_types"


def as_placement(p):
    """``p`` as a dtorch placement: dtorch's own unchanged, torch.distributed.tensor's
    ``Shard``/``Replicate``/``Partial`` converted; anything else raises PlacementError."""
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    if type(p).__module__ == TORCH_PLACEMENTS:
        return _from_torch(p, sys.modules[TORCH_PLACEMENTS])
    raise PlacementError(f"{p!r} is not a placement; use Shard(dim), Replicate() or Partial(op)")


def _from_torch(p, torch_types):
    kind = type(p)
    if kind is torch_types.Shard:
        return Shard(p.dim)
    if kind is torch_types.Replicate:
        return Replicate()
    if kind is torch_types.Partial:
        return Partial(p.reduce_op)
    if kind.__name__ == "_StridedShard":
        raise PlacementError(
            f"torch's _StridedShard ({p!r}: dim={p.dim}, split_factor={p.split_factor}) has no dtorch "
            "equivalent: it is DTensor's layout for a dim sharded twice out of mesh-dim order (FSDP2 over "
            "TP). dtorch nests shards of one tensor dim in mesh-dim order; give Shard(dim) on each mesh dim"
        )
    raise PlacementError(
        f"torch placement {kind.__name__} ({p!r}) has no dtorch equivalent; use Shard(dim), Replicate() "
        "or Partial(op)"
    )


def as_layout(layout):
    """A style's layout argument (one placement, a sequence of them with None for "leave alone",
    or None) with torch's placements converted."""
    if layout is None:
        return None
    if isinstance(layout, (list, tuple)):
        return tuple(None if p is None else as_placement(p) for p in layout)
    return as_placement(layout)


def refuse_torch_mesh(mesh, where: str) -> None:
    """Raise if ``mesh`` is torch.distributed's DeviceMesh, which a single controller cannot use."""
    if type(mesh).__module__ == "torch.distributed.device_mesh":
        raise PlacementError(
            f"{where} got torch.distributed's DeviceMesh {mesh!r}; dtorch meshes come from "
            "dt.init_device_mesh(device_type, shape, mesh_dim_names=...) after dt.init(), which spans the "
            "session's workers (there is no process group to join)"
        )
