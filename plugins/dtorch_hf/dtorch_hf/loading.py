"""One model of a local directory built on the meta device and its weights read straight into
shards on the workers: the controller never holds a weight.

1. The model is built from its ``config.json`` inside ``dt.nn.meta_init()`` (no memory; the
   initialisation is recorded), and its floating tensors given the asked dtype (still meta).
2. ``dtorch_hf.parallelize`` lays it out on the mesh by its family's plan (a model no family
   serves is replicated), inside ``meta_as_uninitialised()``: every parameter and buffer
   becomes uninitialised shards on the workers.
3. The controller reads only the weights files' headers (names, shapes; safetensors, or .bin
   pickles loaded onto the meta device: ``weight_files``) and sends each rank the regions its
   shards hold; each worker reads them from the files itself (the kernel
   ``dtorch_hf::read_weights``, converting the dtype).
4. Buffers the files do not hold (non-persistent ones such as CLIP's ``position_ids``, or
   persistent ones a checkpoint left out) get the values the model's constructor gives them:
   the recorded initialisation, less its random draws, is replayed for just those buffers on
   the workers (``dtorch::materialize``). A parameter the files lack is an error.
"""

from __future__ import annotations

import copy
import os
import time

import structlog
import torch
from torch import nn

import dtorch_core as dt
from dtorch_core.api import meta_as_uninitialised
from dtorch_core.checkpoint.calls import run_kernel
from dtorch_core.errors import CheckpointMismatchError, MaterializeError
from dtorch_core.ir.instructions import Slot
from dtorch_core.mesh import DeviceMesh, root_coordinate
from dtorch_core.nn.kernel_call import call_kernel
from dtorch_core.nn.parallelize import replicate_rest
from dtorch_core.tensor import DTensor

from .errors import UnknownModelError
from .key_names import checkpoint_keys
from .lookup import family_for
from .parallelize import parallelize
from .weight_files import (
    NotAPretrainedModelError,
    header,
    is_sharded_checkpoint,
    weight_files,
)
from .weights_kernel import READ_WEIGHTS_KERNEL

__all__ = ["NotAPretrainedModelError", "load_model", "place_on_mesh"]

log = structlog.get_logger(__name__)

def build_on_meta(cls, directory: str, library: str, torch_dtype=None):
    """``cls`` built from ``directory``'s config on the meta device, its initialisation recorded;
    returns ``(model, trace)``. As each library builds it: diffusers in float32 (cast after),
    transformers in ``torch_dtype`` or else the config's ``dtype``."""
    if library == "diffusers":
        config = cls.load_config(directory)
        with dt.nn.meta_init() as trace:
            model = cls.from_config(config)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory)
        with dt.nn.meta_init() as trace:
            model = cls._from_config(config, **({"dtype": torch_dtype} if torch_dtype is not None else {}))
    return model.eval(), trace


def _fp32_modules(model, torch_dtype) -> set:
    # transformers' own rule for modules kept in float32 under a half dtype (T5's "wo" in fp16)
    plan = getattr(model, "_get_dtype_plan", None)
    if torch_dtype is None or plan is None:
        return set()
    return {name for name, dtype in plan(torch_dtype).items() if dtype == torch.float32}


def _cast_on_meta(model: nn.Module, torch_dtype) -> None:
    """Give the floating parameters and buffers ``torch_dtype`` (meta tensors: nothing computed);
    tied parameters stay tied."""
    if torch_dtype is None:
        return
    keep = _fp32_modules(model, torch_dtype)
    done: dict = {}
    for prefix, module in model.named_modules():
        dtype = torch.float32 if keep & set(prefix.split(".")) else torch_dtype
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in done:
                    new = torch.empty_like(t, dtype=dtype, device="meta")
                    done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
                table[name] = done[id(t)]


def place_on_mesh(model: nn.Module, mesh: DeviceMesh, sp_mode: str) -> str:
    """Lay ``model`` out on ``mesh``: its family's plan over the dims it uses, replicated over the
    others (a pipeline's text encoders and VAE on the transformer's mesh); a model no family
    serves is replicated. Returns how (the family's name, or "replicated")."""
    try:
        family = family_for(model)
    except UnknownModelError:
        replicate_rest(model, mesh)
        return "replicated"
    parallelize(model, mesh, sp_mode=sp_mode, unused_dims="replicate")
    return family.name


def _slots(model: nn.Module) -> dict:
    """``{qualified name: [every name of the same tensor]}`` of the parameters and buffers,
    one entry per tensor (tied parameters share one)."""
    seen: dict = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    seen.setdefault(id(t), []).append(f"{prefix}.{name}" if prefix else name)
    return {names[0]: names for names in seen.values()}


def _is_parameter(model: nn.Module, qualname: str) -> bool:
    prefix, _, name = qualname.rpartition(".")
    return name in model.get_submodule(prefix)._parameters


def _tensor(model: nn.Module, qualname: str):
    prefix, _, name = qualname.rpartition(".")
    module = model.get_submodule(prefix)
    return module._parameters.get(name, module._buffers.get(name))


def load_model(cls, directory: str, library: str, mesh: DeviceMesh, *, torch_dtype=None,
               sp_mode: str = "ulysses", variant: str | None = None, key_mapping: dict | None = None) -> nn.Module:
    """``cls`` (a diffusers ModelMixin or transformers PreTrainedModel class) loaded from
    ``directory`` onto ``mesh``: built on the meta device, laid out by its family, each worker
    reading its own shards from the weights files (checkpoint keys renamed as the library renames
    them, ``key_names``; ``key_mapping``: transformers' regexes)."""
    start = time.monotonic()
    directory = os.path.abspath(directory)  # the workers may run in another cwd
    files = weight_files(directory, library, variant)
    model, trace = build_on_meta(cls, directory, library, torch_dtype)
    keys = checkpoint_keys(model, files, library, sharded=is_sharded_checkpoint(directory, library, variant),
                           key_mapping=key_mapping)
    slots = _slots(model)
    originals = {q: _tensor(model, q) for q in slots}  # the recorded meta tensors
    _cast_on_meta(model, torch_dtype)
    read, computed, missing = {}, [], []
    for qualname, names in slots.items():
        found = next((n for n in names if n in keys), None)
        if found is not None:
            read[qualname] = keys[found]
        elif _is_parameter(model, qualname):
            missing.append(qualname)
        else:
            computed.append(qualname)
    if missing:
        raise CheckpointMismatchError(
            f"{directory} lacks weights of {cls.__name__}: {missing[:10]}{' ...' if len(missing) > 10 else ''} "
            f"({len(missing)} missing); is it a checkpoint of this model and config?", missing=missing)
    used = {keys[n] for names in slots.values() for n in names if n in keys}
    unexpected = sorted(set(files) - used)
    if unexpected:
        log.warning("weights the model does not use, left unread", model=cls.__name__, keys=unexpected[:10],
                    count=len(unexpected))
    with meta_as_uninitialised():
        how = place_on_mesh(model, mesh, sp_mode)
    nbytes = _read_weights(model, directory, files, read)
    _compute_buffers(model, trace, originals, computed)
    log.info("loaded", model=cls.__name__, layout=how, tensors=len(read), computed=len(computed),
             bytes=nbytes, seconds=round(time.monotonic() - start, 3))
    return model


def _read_weights(model: nn.Module, directory: str, files: dict, read: dict) -> int:
    """Every worker reads its regions of the ``read`` tensors (qualified name -> file name)."""
    headers = {f: header(directory, f) for f in sorted({files[n] for n in read.values()})}
    by_mesh: dict = {}
    mismatched = {}
    for qualname, key in read.items():
        dest = _tensor(model, qualname)
        if not isinstance(dest, DTensor):
            raise MaterializeError(f"{qualname} was not laid out on the mesh; is it registered on the model?")
        shape = headers[files[key]][key]
        if tuple(shape) != tuple(dest.shape):
            mismatched[qualname] = f"file {shape}, model {tuple(dest.shape)}"
        by_mesh.setdefault(dest._spec.mesh, []).append((dest, files[key], key, shape))
    if mismatched:
        raise CheckpointMismatchError(f"{directory}: weights of other shapes than the model's: {mismatched}",
                                      mismatched=mismatched)
    nbytes = 0
    for mesh, items in by_mesh.items():
        per_rank = {}
        args = tuple(Slot(i) for i in range(len(items)))
        for rank in mesh.ranks:
            coord = root_coordinate(mesh, rank)
            reads = tuple((slot, file, key, shape, tuple((o, o + n) for o, n in dest._spec.region(coord)))
                          for slot, (dest, file, key, shape) in enumerate(items))
            per_rank[rank] = (args, {"directory": directory, "reads": reads})
        done = run_kernel(mesh, READ_WEIGHTS_KERNEL, [d for d, *_ in items], per_rank, "dtorch_hf weights read",
                          writes_inputs=True)
        nbytes += sum(b for b, _ in done.values())
    return nbytes


def _compute_buffers(model: nn.Module, trace, originals: dict, computed: list) -> None:
    """Fill the buffers the files lack with the values the constructor gave them: the recorded
    initialisation without its random draws (which no such buffer should need, and which
    would make every worker draw the whole model's initial weights) replayed for them alone."""
    deterministic = copy.copy(trace)
    deterministic.steps = [s for s in trace.steps if not s.random]
    by_mesh: dict = {}
    for qualname in computed:
        by_mesh.setdefault(_tensor(model, qualname)._spec.mesh, []).append(qualname)
    for names in by_mesh.values():
        # raises MaterializeError naming a buffer whose value came from a random draw
        program = deterministic.compile([(q, originals[q]) for q in names])
        dests = [_tensor(model, q) for q in names]
        specs = [d._spec for d in dests]

        def regions(rank, coord, specs=specs):
            return {"regions": tuple(spec.region(coord) for spec in specs)}

        call_kernel("dtorch::materialize", dests, writes=tuple(range(len(dests))),
                    kwargs={**program.kernel_kwargs(), "rng_state": trace.rng_state}, rank_kwargs=regions,
                    op_name="dtorch_hf.from_pretrained buffers", cache=False)
