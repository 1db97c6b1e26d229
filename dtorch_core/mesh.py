"""DeviceMesh: an N-D grid of device ranks with named dims.

A sub-mesh (``mesh["tp"]``) is a view of its root mesh that keeps some dims. On a single
controller it stands for every group along those dims at once: a tensor placed on it is
replicated over the root dims the view leaves out. Internally every spec lives on the root.
"""

from __future__ import annotations

import itertools
import math

import attrs

from .errors import PlacementError


@attrs.frozen(cache_hash=True)
class DeviceMesh:
    """An N-D grid of device ranks. Build one with ``dt.init_device_mesh``."""

    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # row-major over the root shape
    mesh_dim_names: tuple[str, ...] | None = None
    root_dims: tuple[int, ...] | None = None  # None: this mesh is a root
    root_shape: tuple[int, ...] | None = attrs.field(default=None, eq=False)
    # a view's root is found by its devices and names: meshes of the same devices with other dim
    # names are other meshes
    root_names: tuple[str, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_root(self) -> bool:
        return self.root_dims is None

    @property
    def root(self) -> "DeviceMesh":
        if self.root_dims is None:
            return self
        return _root_cache(self)

    @property
    def dims_in_root(self) -> tuple[int, ...]:
        return tuple(range(self.ndim)) if self.root_dims is None else self.root_dims

    def size(self, mesh_dim: int | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self.shape)
        return self.shape[mesh_dim]

    def _dim_index(self, name: int | str) -> int:
        if isinstance(name, int):
            return name
        if not self.mesh_dim_names or name not in self.mesh_dim_names:
            raise PlacementError(f"mesh has no dim named {name!r}; its dims are {self.mesh_dim_names}")
        return self.mesh_dim_names.index(name)

    def __getitem__(self, names) -> "DeviceMesh":
        if isinstance(names, (str, int)):
            names = (names,)
        idx = tuple(self._dim_index(n) for n in names)
        root = self.root
        root_dims = tuple(self.dims_in_root[i] for i in idx)
        if root_dims == tuple(range(root.ndim)):
            return root
        return DeviceMesh(
            root.device_type,
            tuple(root.shape[d] for d in root_dims),
            root.ranks,
            tuple(root.mesh_dim_names[d] for d in root_dims) if root.mesh_dim_names else None,
            root_dims,
            root.shape,
            root.mesh_dim_names,
        )

    def get_coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` along this mesh's dims, or None if the rank is not on it."""
        full = root_coordinate(self.root, rank)
        if full is None:
            return None
        return tuple(full[d] for d in self.dims_in_root)

    def groups(self, mesh_dim: int) -> list[tuple[int, ...]]:
        """Rank groups along ``mesh_dim`` (of the root): one tuple per group, in coordinate order."""
        root = self.root
        d = self.dims_in_root[mesh_dim]
        others = [range(n) for i, n in enumerate(root.shape) if i != d]
        out = []
        for rest in itertools.product(*others):
            group = []
            for k in range(root.shape[d]):
                coord = list(rest)
                coord.insert(d, k)
                group.append(root.ranks[_flat_index(root.shape, coord)])
            out.append(tuple(group))
        return out

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, shape={self.shape}{names})"


def _flat_index(shape, coord) -> int:
    idx = 0
    for n, c in zip(shape, coord):
        idx = idx * n + c
    return idx


_ROOTS: dict = {}


def _root_cache(view: DeviceMesh) -> DeviceMesh:
    key = (view.device_type, view.root_shape, view.ranks, view.root_names)
    root = _ROOTS.get(key)
    if root is None:
        raise PlacementError("sub-mesh refers to a root mesh that no longer exists")
    return root


def register_root(mesh: DeviceMesh) -> DeviceMesh:
    """The one root mesh of these devices and dim names (made once, shared by every view)."""
    key = (mesh.device_type, mesh.shape, mesh.ranks, mesh.mesh_dim_names)
    return _ROOTS.setdefault(key, mesh)


def root_coordinate(root: DeviceMesh, rank: int) -> tuple[int, ...] | None:
    try:
        flat = root.ranks.index(rank)
    except ValueError:
        return None
    coord = []
    for n in reversed(root.shape):
        coord.append(flat % n)
        flat //= n
    return tuple(reversed(coord))
