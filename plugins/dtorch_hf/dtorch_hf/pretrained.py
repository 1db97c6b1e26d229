"""``dtorch_hf.from_pretrained``: a local diffusers pipeline or transformers/diffusers model
directory, with every model on the mesh and its weights read straight into shards.

A pipeline (``model_index.json``: ``StableDiffusion3Pipeline``, ``FluxPipeline``) gets each
of its models loaded by ``loading.load_model`` on the one mesh (the transformer by its family
over every dim; text encoders and the VAE by theirs, replicated over the dims they cannot use),
and the rest (scheduler, tokenizers) loaded by diffusers on the controller. The pipeline is
diffusers' own class, called as usual: the scheduler steps on the controller (its arithmetic on
DTensors goes to the workers), diffusers' progress bar shows, and the images come back as PIL
images, because the VAE decoder's output is read onto the controller (a forward hook) before
diffusers' ``postprocess`` calls ``.cpu().numpy()``.

A model directory (``config.json``) gives that model: transformers' when the config names an
``architectures`` class (a T5 checkpoint gives the tensor-parallel T5), diffusers' when it has a
``_class_name``.
"""

from __future__ import annotations

import importlib
import json
import os

import structlog
import torch

import dtorch_core as dt
from dtorch_core.mesh import DeviceMesh

from .loading import NotAPretrainedModelError, load_model

log = structlog.get_logger(__name__)

# the pipelines whose every component dtorch_hf has been tested with on a mesh
PIPELINES = ("StableDiffusion3Pipeline", "FluxPipeline")


def from_pretrained(path, *, mesh: DeviceMesh, torch_dtype: torch.dtype | None = None, sp_mode: str = "ulysses",
                    variant: str | None = None, key_mapping: dict[str, str] | None = None):
    """Load the local pipeline or model at ``path`` onto ``mesh``.

    ``path`` is a directory written by ``save_pretrained``: a diffusers pipeline
    (``model_index.json``; ``StableDiffusion3Pipeline`` or ``FluxPipeline``) or one model
    (``config.json``: a transformers model such as ``T5EncoderModel``, or a diffusers one).
    Every model is built on the meta device and laid out by its family over the mesh's named
    dims (``"tp"``, ``"sp"`` with ``sp_mode``, ``"cfg"``; see ``dtorch_hf.parallelize``), or
    replicated where no family serves it; each worker reads its own shards from the
    weights files (safetensors, or else ``.bin`` pickles, read with ``weights_only=True``),
    converting to ``torch_dtype`` (floating tensors; transformers' float32-kept modules stay
    float32; without it each library's default: float32 for diffusers, the config's ``dtype``
    for transformers). ``variant`` picks ``*.{variant}.safetensors`` (``.bin``) files.
    Checkpoint keys are renamed as each library renames them on load (diffusers' legacy
    attention names; transformers' renamings); ``key_mapping`` is transformers' argument of that
    name (``{regex: replacement}`` applied to the checkpoint keys of a transformers model).
    Nothing is downloaded: a path that is not such a directory raises
    ``NotAPretrainedModelError`` naming what is missing.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise NotAPretrainedModelError(f"{path} is not a directory; dtorch_hf.from_pretrained loads local "
                                       "directories written by save_pretrained (nothing is downloaded)")
    options = {"mesh": mesh, "torch_dtype": torch_dtype, "sp_mode": sp_mode, "variant": variant}
    if os.path.isfile(os.path.join(path, "model_index.json")):
        if key_mapping:
            raise NotAPretrainedModelError(f"{path} is a pipeline; key_mapping renames the keys of one "
                                           "transformers model's checkpoint")
        return load_pipeline(path, **options)
    if os.path.isfile(os.path.join(path, "config.json")):
        cls, library = model_class(path)
        return load_model(cls, path, library, **options, key_mapping=key_mapping)
    raise NotAPretrainedModelError(
        f"{path} has neither model_index.json (a diffusers pipeline) nor config.json (a transformers or "
        f"diffusers model); found {sorted(os.listdir(path))}")


def model_class(path: str):
    """``(class, library)`` of the model whose ``config.json`` is in ``path``."""
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    if "_class_name" in config:
        library, name = "diffusers", config["_class_name"]
    elif config.get("architectures"):
        library, name = "transformers", config["architectures"][0]
    else:
        raise NotAPretrainedModelError(f"{config_file} names no model class: it has neither '_class_name' "
                                       "(diffusers) nor 'architectures' (transformers)")
    return _import(library, name, config_file), library


def _import(library: str, name: str, where: str):
    try:
        return getattr(importlib.import_module(library), name)
    except (ImportError, AttributeError) as exc:
        raise NotAPretrainedModelError(f"{where} names {library}.{name}, which this environment lacks: {exc}") from exc


def load_pipeline(path: str, *, mesh: DeviceMesh, torch_dtype=None, sp_mode: str = "ulysses", variant=None):
    """The diffusers pipeline saved in ``path`` with its models on ``mesh`` (see ``from_pretrained``)."""
    index_file = os.path.join(path, "model_index.json")
    with open(index_file) as f:
        index = json.load(f)
    name = index.get("_class_name")
    if name not in PIPELINES:
        raise NotAPretrainedModelError(
            f"{index_file} is a {name} pipeline; dtorch_hf.from_pretrained serves {list(PIPELINES)} "
            "(load another pipeline with diffusers and parallelize its models with dtorch_hf.parallelize)")
    pipeline_class = _import("diffusers", name, index_file)
    models = {}
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        library, class_name = entry
        cls = _import(library, class_name, index_file)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue  # schedulers and tokenizers: diffusers loads them below, on the controller
        directory = os.path.join(path, component)
        if not os.path.isdir(directory):
            raise NotAPretrainedModelError(f"{path} lacks the folder {component}/ that model_index.json lists "
                                           f"({class_name})")
        models[component] = load_model(cls, directory, "diffusers" if library == "diffusers" else "transformers",
                                       mesh, torch_dtype=torch_dtype, sp_mode=sp_mode, variant=variant)
    pipe = pipeline_class.from_pretrained(path, **models)
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        vae.decoder.register_forward_hook(_gather_decoded)
    log.info("pipeline loaded", pipeline=name, models=sorted(models), mesh=repr(mesh))
    return pipe


def _gather_decoded(module, args, output):
    # diffusers' image postprocessing calls .cpu().numpy() on the decoded images, which a
    # DTensor has no data for: read them onto the controller here (the pipeline's one read)
    return output.full_tensor() if isinstance(output, dt.DTensor) else output
