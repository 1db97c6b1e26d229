"""dtorch_hf: HuggingFace models on a dtorch mesh, parallelized by their family's plan."""

from __future__ import annotations

from .errors import UnknownModelError, UnsupportedMeshDimError
from .family import MESH_DIMS, ModelFamily
from .lookup import families, family_for
from .parallelize import parallelize

__all__ = ["MESH_DIMS", "ModelFamily", "UnknownModelError", "UnsupportedMeshDimError", "families",
           "family_for", "parallelize"]
