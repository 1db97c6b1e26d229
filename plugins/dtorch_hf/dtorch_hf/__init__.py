"""dtorch_hf: HuggingFace models on a dtorch mesh, parallelized by their family's plan."""

from __future__ import annotations

from .errors import UnknownModelError, UnsupportedMeshDimError
from .family import MESH_DIMS, ModelFamily
from .loading import NotAPretrainedModelError
from .lookup import family_for, registered_families
from .parallelize import parallelize
from .pretrained import from_pretrained

__all__ = ["MESH_DIMS", "ModelFamily", "NotAPretrainedModelError", "UnknownModelError", "UnsupportedMeshDimError",
           "family_for", "from_pretrained", "parallelize", "registered_families"]
