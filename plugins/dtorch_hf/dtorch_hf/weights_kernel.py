"""The worker kernel of ``from_pretrained``: read this rank's regions of named tensors of a
model directory's weights files (safetensors or .bin) into its local shards, converting the dtype.

The core checkpoint kernel (``dtorch::checkpoint_read``) refuses to convert, since a dtorch
checkpoint holds the dtypes it was saved with; a HuggingFace directory often holds fp32 or bf16
weights that a pipeline loads in another dtype (``torch_dtype=``), so here each region is
copied with ``copy_``, which converts. Files are opened by ``weight_files.open_weights`` (as
the core kernel opens its files: a regular file directly inside the directory, no links),
mmap'd, and only the regions asked for are read.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from dtorch_core.checkpoint.kernels import CheckpointFileError

from .weight_files import open_weights

READ_WEIGHTS_KERNEL = "dtorch_hf::read_weights"


def read_weights_kernel(*dests, directory: str, reads: tuple):
    """Fill ``dests`` (this rank's local shards) in place: ``reads`` is ``(slot, file, name,
    shape, region)`` per tensor, ``region`` the ``((start, stop), ...)`` of tensor ``name``
    (which must have ``shape``) that ``dests[slot]`` holds. Returns ``[[bytes, count]]``."""
    by_file = defaultdict(list)
    for r in reads:
        by_file[r[1]].append(r)
    nbytes = 0
    for file, items in by_file.items():
        try:
            with open_weights(directory, file) as f:
                for slot, _file, name, shape, region in items:
                    if f.shape(name) != tuple(shape):
                        raise ValueError(f"holds {name!r} of shape {f.shape(name)}, expected {tuple(shape)}")
                    if dests[slot].numel() == 0:
                        continue
                    value = f.read(name, region)
                    with torch.no_grad():
                        dests[slot].copy_(value.reshape(dests[slot].shape))
                    nbytes += value.numel() * value.element_size()
        except Exception as exc:
            raise CheckpointFileError(os.path.join(directory, file), "read", exc) from exc
    return torch.tensor([[nbytes, len(reads)]], dtype=torch.int64)


def register(registry) -> None:
    registry.add(READ_WEIGHTS_KERNEL, read_weights_kernel)
