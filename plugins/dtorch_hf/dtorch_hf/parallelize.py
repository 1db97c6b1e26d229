"""``dtorch_hf.parallelize``: a model's family plan applied over a mesh's named dims."""

from __future__ import annotations

import fnmatch

import structlog
import torch.nn as nn

from dtorch_core.errors import PlacementError
from dtorch_core.mesh import DeviceMesh
from dtorch_core.nn.parallelize import replicate_rest
from dtorch_core.nn.styles import ParallelStyle
from dtorch_core.nn.torch_styles import from_torch_style, is_torch_style

from .batch import split_batch_on_entry
from .errors import UnsupportedMeshDimError
from .lookup import family_for
from .mesh_dims import read_mesh_dims
from .ring import set_sp_mode
from .styles import apply_style

log = structlog.get_logger(__name__)

SP_MODES = ("ulysses", "ring")
UNUSED_DIMS = ("error", "replicate")
BATCH_DIMS = ("dp", "cfg")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, sp_mode: str = "ulysses", plan: dict | None = None,
                unused_dims: str = "error") -> nn.Module:
    """Parallelize ``model`` in place over ``mesh`` and return it.

    Mesh dims are read by name: ``"tp"`` (the family's tensor-parallel plan, or ``plan``),
    ``"dp"`` and ``"cfg"`` (the batch split where inputs enter the model: a pipeline's
    conditional and unconditional halves land on different devices), ``"sp"`` (sequence
    parallel, with ``sp_mode`` "ulysses" or "ring"), in any subset and order; a dim the model's
    family cannot use raises ``UnsupportedMeshDimError``, or with ``unused_dims="replicate"``
    the model is replicated over it (how a pipeline puts its text encoders and VAE on the
    transformer's mesh). ``plan`` (``{glob pattern: style}``
    as ``dt.nn.parallelize_module`` takes) replaces the family's tp plan. Every parameter and
    buffer not sharded is replicated on the whole mesh. The model is called as before; its
    outputs hold dtorch DTensors (``.full_tensor()`` reads one on the controller).
    """
    if unused_dims not in UNUSED_DIMS:
        raise UnsupportedMeshDimError(f"unused_dims={unused_dims!r}; it takes one of {UNUSED_DIMS}")
    if sp_mode not in SP_MODES:
        raise UnsupportedMeshDimError(f"sp_mode={sp_mode!r}; it takes one of {SP_MODES}")
    family = family_for(model)
    dims = read_mesh_dims(mesh, family, type(model).__name__, replicate_unused=unused_dims == "replicate")
    if "sp" in dims.index and sp_mode not in family.sp_modes:
        raise UnsupportedMeshDimError(
            f"sp_mode={sp_mode!r} is not supported for {type(model).__name__} yet (family {family.name!r} "
            f"serves {list(family.sp_modes)}); pass sp_mode={family.sp_modes[0]!r}" if family.sp_modes else
            f"{type(model).__name__} has no sequence-parallel mode")
    chosen = family.tp_plan(model) if plan is None else plan
    set_sp_mode(model, sp_mode)  # the families' attention processors read it (ring.py)
    if chosen and "tp" not in dims.index:
        if plan is not None:
            raise UnsupportedMeshDimError(
                f"plan= shards over the mesh dim 'tp', and this mesh has dims {mesh.mesh_dim_names}; "
                "add a 'tp' dim or leave plan out")
        chosen = {}
    if dims.size("tp") == 1:
        # a "tp" dim of one device shards nothing, while the styles' hooks would still lay
        # every activation out again on it (a copy of the whole tensor each on the worker)
        chosen = {}
    named = dict(model.named_modules())
    for pattern, style in chosen.items():
        if is_torch_style(style):  # torch.distributed.tensor.parallel's styles, as parallelize_module takes them
            style = from_torch_style(style)
        if not isinstance(style, ParallelStyle):
            raise PlacementError(f"plan entry {pattern!r} is {style!r}, not a parallel style (dt.nn.ColwiseParallel, ...)")
        hits = [name for name in named if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise PlacementError(f"plan pattern {pattern!r} matches no sub-module of {type(model).__name__}; "
                                 f"names look like {[n for n in named if n][:5]}")
        for name in hits:
            apply_style(style, named[name], mesh, "tp")
    replicate_rest(model, mesh)
    batch_dims = [dims.index[name] for name in BATCH_DIMS if dims.size(name) > 1]
    if batch_dims:
        hooked = split_batch_on_entry(model, mesh, batch_dims, family.batch_modules, family.batch_kwargs)
        log.debug("batch split", dims=[n for n in BATCH_DIMS if dims.size(n) > 1], modules=hooked)
    log.debug("parallelized", model=type(model).__name__, family=family.name, mesh=repr(mesh),
              plan_entries=len(chosen))
    return model
