"""Attention masks for ring attention: a mask over the joint sequence, cut into the blocks each
rank meets at each ring step.

A mask (boolean, True = attend, or additive float; broadcastable to (batch, heads, queries,
keys) of the joint sequence, the streams concatenated in the order they are given) is made a
replicated DTensor and laid out on the workers, so nothing about its values is computed on the
controller (it replays under dt.compile as an input, not a frozen constant):

- its rows and columns are taken in the block layout of ring.py (streams side by side, each
  padded at its end; padded keys masked), so rank i's rows are its query block;
- the key blocks are skewed so that ring step t's block sits at index t: at step t rank i holds
  key block (i + t) % n;
- the result is sharded as the queries are (batch over "cfg"/"dp", blocks over "sp", heads over
  "tp" where the mask has a heads dim): from Replicate that is a local slice on each rank.

Each query row is then shifted by its largest entry over all keys (softmax does not change),
so every row that can attend somewhere has an entry 0 and its log-sum-exp stays an ordinary
number; masked entries become the dtype's minimum (finite, so a block in which a row is wholly
masked gives a finite log-sum-exp that the merge weighs to exactly zero, and no NaN). A row
masked at every key (all False, or all -inf) is a dead row: scaled_dot_product_attention gives
0 there (its safe softmax), and so does the ring (``live`` is False there; ring.py zeroes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard

NEG_INF = float("-inf")


def block_positions(lengths, n: int) -> torch.Tensor:
    """(n, sum of the streams' blocks) int64: for block i (rank i's), the position in the
    joint sequence of each of its slots, -1 on padding. Block i of a stream of length s holds
    its tokens ``i * ceil(s / n)`` on (torch.chunk's layout, which the sequence shards have)."""
    columns, start = [], 0
    for length in lengths:
        block = -(-length // n)
        pos = torch.arange(n * block).view(n, block)
        columns.append(torch.where(pos < length, pos + start, -1))
        start += length
    return torch.cat(columns, dim=1)


class RingMask:
    """An attention mask for ring attention, laid out (:func:`lay_out_mask`) once per layout of
    the queries it meets and then reused. A model passes one mask to each of its attention calls
    (Flux: every block, over the same streams), so wrapping it once per model call (the Flux
    family's entry hook does) lays it out once per call instead of once per block. It lives as
    long as the call's arguments: nothing outlives the call, and a mask changed between calls is
    laid out anew."""

    def __init__(self, mask):
        self.mask = mask
        self._laid_out = {}

    def biases(self, lengths, q) -> tuple[list, object]:
        key = (tuple(lengths), tuple(q.shape), tuple(q.placements), q.dtype, q.device_mesh)
        if key not in self._laid_out:
            self._laid_out[key] = lay_out_mask(self.mask, block_positions(lengths, q.shape[1]), q)
        return self._laid_out[key]


def lay_out_mask(mask, positions: torch.Tensor, q) -> tuple[list, object]:
    """Per ring step the additive bias (batch * n, heads or 1, queries or 1, keys) of the key
    block each rank holds then, in ``q``'s dtype and laid out as the kernels' inputs; and
    ``live`` (batch, n, heads or 1, queries or 1, 1), False on dead rows. ``q``: the query
    blocks (batch, n, heads, block, head_dim); ``positions``: :func:`block_positions`."""
    batch, n, heads = q.shape[:3]
    total = int(positions.max()) + 1
    bias = _as_bias(_broadcast_4d(_replicated(mask, q.device_mesh), batch, heads, total))
    rows = bias.shape[2]
    slots = torch.where(positions >= 0, positions, total).flatten()  # padding: the added column/row
    bias = F.pad(bias, (0, 1), value=NEG_INF).index_select(3, slots).unflatten(3, (n, -1))
    if rows > 1:
        bias = F.pad(bias, (0, 0, 0, 0, 0, 1), value=0.0).index_select(2, slots).unflatten(2, (n, -1))
    else:
        bias = bias.unsqueeze(2).expand(-1, -1, n, -1, -1, -1)
    # (batch, heads, query block, rows, key block, keys) -> (batch, query block, step, heads, rows, keys)
    bias = bias.permute(0, 2, 4, 1, 3, 5).flatten(1, 2)
    skew = torch.tensor([i * n + (i + t) % n for i in range(n) for t in range(n)])
    bias = bias.index_select(1, skew).unflatten(1, (n, n)).expand(batch, -1, -1, -1, -1, -1)
    bias = bias.redistribute(q.device_mesh, _placements(q, keep_heads=bias.shape[3] > 1))
    top = bias.amax(dim=(2, 5), keepdim=True)  # each query row's largest entry over every key
    live = top > NEG_INF
    bias = (bias - torch.where(live, top, 0.0)).clamp_min(torch.finfo(q.dtype).min).to(q.dtype)
    steps = [bias[:, :, t].flatten(0, 1).contiguous() for t in range(n)]
    return steps, live.squeeze(2)


def _replicated(mask, mesh):
    if isinstance(mask, dt.DTensor):
        if mask.device_mesh != mesh:
            raise ValueError("the attention mask is a DTensor of another mesh than the attention's inputs")
        return mask.redistribute(mesh, [Replicate()] * mesh.ndim)
    return dt.distribute_tensor(mask, mesh, [Replicate()] * mesh.ndim)


def _broadcast_4d(mask, batch: int, heads: int, total: int):
    """``mask`` as (batch or 1, heads or 1, total or 1, total), as scaled_dot_product_attention
    broadcasts it (right-aligned)."""
    if mask.ndim > 4:
        raise ValueError(f"an attention mask has at most 4 dims (batch, heads, queries, keys), not {mask.ndim}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    wanted = (batch, heads, total, total)
    if any(size not in (1, full) for size, full in zip(mask.shape, wanted)):
        raise ValueError(f"the attention mask's shape {tuple(mask.shape)} does not broadcast to "
                         f"(batch, heads, queries, keys) = {wanted}")
    return mask.expand(-1, -1, -1, total)


def _as_bias(mask):
    """The fp32 additive bias of a boolean (True: attend) or float mask."""
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, NEG_INF)
    if not mask.dtype.is_floating_point:
        raise TypeError(f"an attention mask is boolean or floating point, not {mask.dtype}")
    return mask.float()


def _placements(q, keep_heads: bool) -> list:
    """Placements of the (batch, query block, step, heads, rows, keys) bias from the query
    blocks' (batch, block, heads, tokens, head_dim): batch and block shards kept, the heads
    shard where the mask has heads (else it broadcasts over them: Replicate)."""
    out = []
    for p in q.placements:
        if p == Shard(0) or p == Shard(1):
            out.append(p)
        elif p == Shard(2) and keep_heads:
            out.append(Shard(3))
        else:
            out.append(Replicate())
    return out
