"""TensorSpec: everything the controller knows about a distributed tensor except its data."""

from __future__ import annotations

import functools
import itertools

import attrs
import torch

from .mesh import DeviceMesh
from .placement import Partial, Replicate, Shard, chunk_extent


@attrs.frozen(cache_hash=True)
class TensorSpec:
    """Global shape/stride/dtype and placements on a root mesh (one placement per root dim)."""

    mesh: DeviceMesh
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    # the native hot path's arguments for a handle of this spec (native/fastpath.cpp), made there
    # at first use; not part of the value
    _native_wrapper: object = attrs.field(default=None, init=False, eq=False, hash=False, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, placements) -> TensorSpec:
        return attrs.evolve(self, placements=tuple(placements))

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def region(self, coord) -> tuple[tuple[int, int], ...]:
        """(offset, length) per tensor dim of the shard at mesh coordinate ``coord``.

        Shards on the same tensor dim nest in mesh-dim order, as in torch DTensor.
        """
        return shard_region(self.shape, self.placements, self.mesh.shape, coord)

    def local_shape(self, coord) -> tuple[int, ...]:
        return tuple(length for _, length in self.region(coord))


# One TensorSpec object per distinct spec: the dispatcher's cache keys hold specs, and a lookup
# whose spec is the very object in the stored key compares by identity instead of attrs' __eq__
# (a Python call per op). DTensors and plans take their specs from here.
_CANONICAL_SPECS: dict = {}
_CANONICAL_LIMIT = 1 << 16


def canonical_spec(spec: TensorSpec) -> TensorSpec:
    """The one object equal to ``spec`` (``spec`` itself the first time)."""
    canonical = _CANONICAL_SPECS.get(spec)
    if canonical is None:
        if len(_CANONICAL_SPECS) >= _CANONICAL_LIMIT:
            _CANONICAL_SPECS.clear()  # a bound, not an eviction policy: equal specs stay correct
        canonical = _CANONICAL_SPECS[spec] = spec
    return canonical


def shard_region(shape, placements, mesh_shape, coord):
    region = [(0, n) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            off, length = region[p.dim]
            ext = chunk_extent(length, mesh_shape[mesh_dim], coord[mesh_dim])
            region[p.dim] = (off + ext.offset, ext.length)
    return tuple(region)


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


@functools.lru_cache(maxsize=8192)
def local_shapes(shape: tuple, placements: tuple, mesh_shape: tuple) -> tuple:
    """The local shape on every rank of a mesh of ``mesh_shape``, in rank (C) order."""
    return tuple(
        tuple(length for _, length in shard_region(shape, placements, mesh_shape, coord))
        for coord in itertools.product(*(range(n) for n in mesh_shape))
    )
