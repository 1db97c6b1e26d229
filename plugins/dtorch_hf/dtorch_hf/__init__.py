"""dtorch_hf: HuggingFace models on a dtorch mesh, parallelized by their family's plan."""

from __future__ import annotations

from .errors import UnknownModelError, UnsupportedMeshDimError
from .family import MESH_DIMS, ModelFamily
from .lookup import family_for, registered_families
from .parallelize import parallelize

__all__ = ["MESH_DIMS", "ModelFamily", "UnknownModelError", "UnsupportedMeshDimError", "family_for",
           "parallelize", "registered_families"]
