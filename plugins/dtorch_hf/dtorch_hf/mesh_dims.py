"""Reading a mesh's dims by name and checking them against what a family can use."""

from __future__ import annotations

import attrs

from dtorch_core.mesh import DeviceMesh

from .errors import UnsupportedMeshDimError
from .family import MESH_DIMS, ModelFamily


@attrs.frozen
class MeshDims:
    """The mesh (its root) and the index of each named dim dtorch_hf uses on it."""

    mesh: DeviceMesh
    index: dict[str, int]

    def size(self, name: str) -> int:
        return self.mesh.size(self.index[name]) if name in self.index else 1


def read_mesh_dims(mesh: DeviceMesh, family: ModelFamily, model_name: str, *,
                   replicate_unused: bool = False) -> MeshDims:
    """The dims of ``mesh`` by name that the family uses; a name dtorch_hf does not know raises
    ``UnsupportedMeshDimError`` saying which names would work, and so does one the family cannot
    use, unless ``replicate_unused`` (then it is left out: the model is replicated over it)."""
    names = mesh.mesh_dim_names
    if not names:
        raise UnsupportedMeshDimError(
            f"dtorch_hf reads mesh dims by name, and this mesh {mesh!r} has none; make it with "
            f"dt.init_device_mesh(..., mesh_dim_names=(...)) using {sorted(MESH_DIMS)}"
        )
    for name in names:
        if name not in MESH_DIMS:
            raise UnsupportedMeshDimError(
                f"mesh dim {name!r} means nothing to dtorch_hf; name the dims among "
                f"{ {k: v for k, v in MESH_DIMS.items()} }"
            )
        if name not in family.dims and not replicate_unused:
            reason = family.refused.get(name, f"the {family.name} family does not use it")
            raise UnsupportedMeshDimError(
                f"mesh dim {name!r} ({MESH_DIMS[name]}) is not supported for {model_name} "
                f"({family.name} family): {reason}; use a mesh with dims among {sorted(family.dims)}"
            )
    return MeshDims(mesh, {name: i for i, name in enumerate(names) if name in family.dims})
