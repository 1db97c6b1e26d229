"""The weight files of a HuggingFace model directory: which files hold which tensors, their
shapes (read without the data), and one file opened to read regions of its tensors.

Two formats, looked for in the order transformers and diffusers look for them, so where both
are present safetensors wins:

- safetensors (``model.safetensors``, ``diffusion_pytorch_model.safetensors``), or a sharded
  checkpoint's ``*.safetensors.index.json``;
- PyTorch pickles (``pytorch_model.bin``, ``diffusion_pytorch_model.bin``), or their
  ``*.bin.index.json``. These are only ever unpickled with ``torch.load(weights_only=True)``
  (a file that needs any other global is refused). The controller loads them with
  ``map_location="meta"`` (the pickle's structure only: names, shapes; no tensor data); a
  worker maps the file (``mmap=True``) and copies out only its regions, so only those pages are
  read. A file of torch's pre-1.6 format (not a zip archive) cannot be mapped: each worker then
  loads the whole file (as transformers and diffusers do for it).

Every file is opened as the core checkpoint opens its files: a regular file directly inside the
directory, no links, and read through that one open descriptor.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import zipfile

import torch

from dtorch_core.checkpoint.kernels import open_data_file
from dtorch_core.checkpoint.layout import as_slices
from dtorch_core.errors import ConfigError


class NotAPretrainedModelError(ConfigError):
    """The directory is not a model or pipeline ``dtorch_hf.from_pretrained`` can load; the
    message names what is missing (a file, a class, a supported pipeline)."""


# each library's (index, single file) per format, in the order they are looked for
WEIGHT_FILES = {
    "diffusers": (("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
                  ("diffusion_pytorch_model.bin.index.json", "diffusion_pytorch_model.bin")),
    "transformers": (("model.safetensors.index.json", "model.safetensors"),
                     ("pytorch_model.bin.index.json", "pytorch_model.bin")),
}


def with_variant(name: str, variant: str | None) -> str:
    """``name`` with ``variant`` before its last suffix, as both libraries name variants:
    ``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``, ``pytorch_model.fp16.bin``."""
    if variant is None:
        return name
    stem, _, ext = name.rpartition(".")
    return f"{stem}.{variant}.{ext}"


def is_sharded_checkpoint(directory: str, library: str, variant: str | None = None) -> bool:
    """Whether ``weight_files`` reads ``directory``'s weights through an index."""
    return _found(directory, library, variant)[0]


def _found(directory: str, library: str, variant: str | None):
    for index, single in WEIGHT_FILES[library]:
        index, single = with_variant(index, variant), with_variant(single, variant)
        if os.path.isfile(os.path.join(directory, index)):
            return True, index
        if os.path.isfile(os.path.join(directory, single)):
            return False, single
    wanted = [with_variant(n, variant) for pair in WEIGHT_FILES[library] for n in reversed(pair)]
    present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    raise NotAPretrainedModelError(f"{directory} has no weights: expected {' or '.join(wanted)}, found {present}")


def weight_files(directory: str, library: str, variant: str | None = None) -> dict:
    """``{tensor name: file name}`` of the model in ``directory`` (one weights file, or a
    sharded checkpoint with its index; safetensors before .bin)."""
    sharded, name = _found(directory, library, variant)
    if not sharded:
        return dict.fromkeys(header(directory, name), name)
    with open(os.path.join(directory, name)) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise NotAPretrainedModelError(f"{os.path.join(directory, name)} has no 'weight_map'; is it a checkpoint index?")
    return dict(weight_map)


def header(directory: str, file: str) -> dict:
    """``{name: shape}`` of the tensors of one weights file, without their data. A name that
    leaves the directory, a link, or a file that is not of its format raises
    NotAPretrainedModelError naming it."""
    try:
        with open_weights(directory, file, meta=True) as f:
            return f.shapes()
    except Exception as exc:  # OSError, safetensors' or torch.load's own errors for a malformed file
        raise NotAPretrainedModelError(f"{directory}: cannot read the weights file {file!r}: "
                                       f"{type(exc).__name__}: {exc}") from exc


class _Safetensors:
    def __init__(self, f):
        self._f = f

    def shapes(self) -> dict:
        return {name: tuple(self._f.get_slice(name).get_shape()) for name in self._f.keys()}  # noqa: SIM118

    def shape(self, name: str) -> tuple:
        return tuple(self._f.get_slice(name).get_shape())

    def read(self, name: str, region) -> torch.Tensor:
        return self._f.get_slice(name)[as_slices(region)]


class _StateDict:
    def __init__(self, state: dict):
        self._state = state

    def shapes(self) -> dict:
        return {name: tuple(t.shape) for name, t in self._state.items()}

    def shape(self, name: str) -> tuple:
        return tuple(self._state[name].shape)

    def read(self, name: str, region) -> torch.Tensor:
        return self._state[name][as_slices(region)]


@contextlib.contextmanager
def open_weights(directory: str, file: str, *, meta: bool = False):
    """The weights file ``file`` directly inside ``directory``, opened for reading: an object
    with ``shapes()``, ``shape(name)`` and ``read(name, region)`` (``region`` the
    ``((start, stop), ...)`` of the tensor). ``meta``: only shapes are wanted (a .bin file is
    then loaded onto the meta device, no data read)."""
    if not file.endswith(".bin"):
        with open_data_file(directory, file) as f:
            yield _Safetensors(f)
        return
    with _open_regular(directory, file) as via:
        mmap = zipfile.is_zipfile(via)
        state = torch.load(via, map_location="meta" if meta else "cpu", weights_only=True,
                           mmap=mmap and not meta)
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise ValueError("is not a state dict (a dict of tensors by name)")
        yield _StateDict(state)


@contextlib.contextmanager
def _open_regular(directory: str, file: str):
    # the same refusals as the core's open_data_file (which opens safetensors only): a name with
    # a path in it, a link, anything but a regular file; yields a path to the one open descriptor
    if file != os.path.basename(file) or file in ("", ".", "..") or "\x00" in file:
        raise PermissionError(f"{file!r} is not a file name inside the checkpoint directory")
    path = os.path.join(directory, file)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermissionError(f"{path} is not a regular file")
        yield f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path
    finally:
        os.close(fd)
