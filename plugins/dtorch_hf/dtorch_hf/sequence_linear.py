"""Linear layers that keep a sequence-sharded batch on its shards.

``nn.Linear`` on a (batch, seq, features) tensor runs as one matmul over a (batch * seq,
features) view. With the sequence sharded over "sp" and more than one batch row per rank,
each rank's part of that merged dim is one run of tokens per batch row, not one contiguous
run: dtorch_core has no (strided) placement for it, so the view all-gathers the sequence and
the rest of the model would run on whole sequences. Here such a call is a batched matmul
instead, ``x @ weight.T`` batched over the batch dim with the weight expanded to it (a view):
batch and sequence stay separate dims and the sequence shard an ordinary Shard(1); the same
values (each output element is the same dot product) and the same tp placements (a colwise
weight shards the output features, a rowwise one gives the partial sums the style reduces).
Where the merge keeps the shards (one batch row per rank, or nothing sharded on the sequence)
the Linear is left to torch.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Shard


def _merge_loses_shards(x) -> bool:
    """True where ``x`` is a DTensor with more than one batch row and its dim 1 (the sequence)
    sharded over a mesh dim of more than one device: flattening (batch, seq) would gather."""
    if not isinstance(x, dt.DTensor) or x.ndim != 3 or x.shape[0] < 2:
        return False
    mesh = x.device_mesh
    return any(p == Shard(1) and mesh.size(i) > 1 for i, p in enumerate(x.placements))


def _forward(self, x):
    if not _merge_loses_shards(x):
        return F.linear(x, self.weight, self.bias)
    weight = self.weight.t().expand(x.shape[0], -1, -1)
    if self.bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(self.bias, x, weight)


def keep_sequence_shards(model: nn.Module) -> None:
    """Make every ``nn.Linear`` of ``model`` run sequence-sharded batches as a batched matmul
    (see the module docstring); other calls run as before. A subclass with a forward of its own
    (a quantized or adapter Linear) is left alone: its forward is not ``F.linear``."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            module.forward = types.MethodType(_forward, module)
