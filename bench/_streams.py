"""The op streams every side of bench/dispatch.py runs, so all of them time the same ops.

A stream is a step function ``step(a, b) -> tensor`` plus the number of ops one step issues.
The same functions run on dtorch handles, on PyTorch DTensors and on plain local tensors.
"""

from __future__ import annotations

import torch

SHARD_ROWS = 64
COLS = 64


def _add(a, b):
    return a + a


def _mix(a, b):
    # A short dependent chain (each op reads the previous result), like real model code; the
    # intermediates are dropped as the chain goes on, so frees are part of the stream too.
    t = a + b
    t = t * b
    return torch.relu(t)


STREAMS = {
    "add": (_add, 1),
    "mix": (_mix, 3),
}


def global_inputs(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two global (64 * world, 64) tensors: Shard(0) gives every rank a 64x64 shard."""
    g = torch.Generator().manual_seed(0)
    shape = (SHARD_ROWS * world_size, COLS)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def local_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two local 64x64 tensors: the shard shape, for the plain-torch anchor."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHARD_ROWS, COLS, generator=g), torch.randn(SHARD_ROWS, COLS, generator=g)
