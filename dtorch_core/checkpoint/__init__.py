"""Sharded checkpoints in safetensors files (``dt.checkpoint``).

```python
dt.checkpoint.save(model, optimizer, "ckpt/", extra={"step": 100})   # every shard written once
extra = dt.checkpoint.load(model, optimizer, "ckpt/")                # onto any mesh and placements
```

A checkpoint is a directory: one safetensors file per writing rank (``rank-00003.safetensors``),
``controller.safetensors`` for plain tensors, and ``index.json`` (global shapes, dtypes,
placements, and which file holds which region of each key). The directory must be on a file
system that the controller and every worker see. Modules: ``saving``/``loading`` (the two calls),
``state`` (keys of model and optimizer state), ``layout`` (region arithmetic), ``index`` (the
index format) with ``schema`` (its fields' types), ``verify`` (the checks of a checkpoint before
it is loaded: it may come from anyone), ``kernels`` (the workers' side), ``calls`` (running
those kernels), ``publish`` (atomic publication).
"""

from __future__ import annotations

from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointIOError,
    CheckpointMismatchError,
)
from .loading import load
from .saving import save

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "load",
    "save",
]
