"""What a model family is: the classes it serves, the mesh dims it can use, its tp plan."""

from __future__ import annotations

from typing import Callable

import attrs
import torch.nn as nn

# every dim name dtorch_hf reads from a mesh, and what it means
MESH_DIMS = {
    "tp": "tensor parallel (weights split over heads / MLP features)",
    "sp": "sequence (context) parallel",
    "cfg": "classifier-free-guidance parallel (conditional and unconditional halves of the batch)",
    "dp": "data parallel (the batch split over devices)",
}


@attrs.frozen
class ModelFamily:
    """One family of models and how dtorch_hf parallelizes it.

    ``model_classes`` are class names (matched against the model's class and its bases, so the
    family's module need not import them); ``dims`` are the mesh dim names it can use;
    ``refused`` maps a dim name it cannot use (yet) to the reason shown to the user;
    ``tp_plan(model)`` gives ``{glob pattern: parallel style}`` as ``dt.nn.parallelize_module``
    takes; ``batch_modules`` are glob patterns of the sub-modules whose ``batch_kwargs`` (plain
    tensors, batch first) are split over ``"dp"`` when they are called; ``sp_modes`` are the
    ``sp_mode`` values it serves on an ``"sp"`` dim.
    """

    name: str
    model_classes: tuple[str, ...]
    dims: frozenset[str]
    tp_plan: Callable[[nn.Module], dict]
    refused: dict[str, str] = attrs.field(factory=dict)
    batch_modules: tuple[str, ...] = ("",)
    batch_kwargs: tuple[str, ...] = ("input_ids", "inputs_embeds")
    sp_modes: tuple[str, ...] = ()

    def serves(self, model: nn.Module) -> bool:
        names = {cls.__name__ for cls in type(model).__mro__}
        return any(name in names for name in self.model_classes)
