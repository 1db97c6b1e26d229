"""Attention masks for ring attention: a mask over the joint sequence, cut into the blocks each
rank meets at each ring step.

A mask (boolean, True = attend, or additive float; broadcastable to (batch, heads, queries,
keys) of the joint sequence, the streams concatenated in the order they are given) is laid out
so that each rank holds only the query rows of its own block (with every key), and no
collective runs:

- each stream's rows are sent to the ranks as that stream's queries are sharded (Shard on the
  rows over "sp": rank i gets the rows of its block i, torch.chunk's layout; the batch over
  "cfg"/"dp" and the heads over "tp" where the mask has those dims): ``dt.distribute_tensor``
  of the controller's mask, or, for a DTensor mask, a redistribution (from Replicate, a local
  slice). A mask with one row (key padding, broadcast over the queries) is what every query
  needs, so it is replicated (sharded on batch/heads as above);
- on the workers each stream's rows are padded to its block (padded queries are cropped
  later) and the streams' row blocks put side by side, as ring.py lays out the queries;
- the keys are taken in the block layout of ring.py (padded keys masked) and skewed so that
  ring step t's block sits at index t (at step t rank i holds key block (i + t) % n): one
  ``gather`` along the keys with a per-rank index, sharded as the rows are, so it is local.

Each query row is then shifted by its largest entry over all keys (softmax does not change),
so every row that can attend somewhere has an entry 0 and its log-sum-exp stays an ordinary
number; masked entries become the dtype's minimum (finite, so a block in which a row is wholly
masked gives a finite log-sum-exp that the merge weighs to exactly zero, and no NaN). A row
masked at every key (all False, or all -inf) is a dead row: scaled_dot_product_attention gives
0 there (its safe softmax), and so does the ring (``live`` is False there; ring.py zeroes it).

Under dt.compile a plain mask argument is replicated where the step binds it (dtorch_core's
rule for plain tensors), so there every rank receives the whole mask before its rows are kept;
a mask that changes each call still replays (it is an input, not a frozen constant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard

NEG_INF = float("-inf")
BLOCK, HEADS = 1, 3  # ring.py's blocks layout: (outer, block, inner, heads, tokens, head_dim)


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
        self._padded = {}

    def for_batch(self, batch: int) -> "RingMask":
        """This mask for queries whose batch ring.py padded to ``batch`` rows: a mask with a batch
        dim gets rows that attend everywhere (the padded queries' outputs are cropped), made once
        per call like the layout; a mask without one is this one."""
        mask = self.mask
        if mask.ndim < 4 or mask.shape[-4] in (1, batch):
            return self
        if batch not in self._padded:
            fill = True if mask.dtype == torch.bool else 0.0
            pad = (0, 0) * (mask.ndim - 1) + (0, batch - mask.shape[0])
            self._padded[batch] = RingMask(F.pad(mask, pad, value=fill))
        return self._padded[batch]

    def biases(self, lengths, q) -> tuple[list, object]:
        key = (tuple(lengths), tuple(q.shape), tuple(q.placements), q.dtype, q.device_mesh)
        if key not in self._laid_out:
            self._laid_out[key] = lay_out_mask(self.mask, tuple(lengths), q)
        return self._laid_out[key]


def lay_out_mask(mask, lengths: tuple, q) -> tuple[list, object]:
    """Per ring step the additive bias (the kernels' leading dim, heads or 1, queries or 1,
    keys) of the key block each rank holds then, in ``q``'s dtype and laid out as the kernels'
    inputs; and ``live`` (q's three leading dims, heads or 1, queries or 1, 1), False on dead
    rows. ``q``: the query blocks in ring.py's layout (outer, block, inner, heads, block length,
    head_dim; the batch is outer x inner); ``lengths``: the streams' lengths."""
    outer, n, inner, heads = q.shape[:4]
    batch, mesh, total = outer * inner, q.device_mesh, sum(lengths)
    mask = _broadcast_4d(mask, batch, heads, total)
    row_dim = None if mask.shape[2] == 1 else 2
    where = _mask_placements(q, mask.shape, row_dim)
    if row_dim is None:
        # one row every query meets: each rank's query block gets a copy of it (a view)
        bias = _as_bias(_placed(mask, mesh, where)).unsqueeze(2).expand(-1, -1, n, -1, -1)
        bias = bias.redistribute(mesh, _mask_placements(q, bias.shape, 2))
    else:
        parts, start = [], 0
        for length in lengths:  # each stream's rows, sharded as its queries are
            rows = _as_bias(_placed(_rows(mask, start, length), mesh, where))
            block = -(-length // n)
            parts.append(F.pad(rows, (0, 0, 0, n * block - length), value=0.0).unflatten(2, (n, block)))
            start += length
        bias = torch.cat(parts, dim=3)  # (batch, heads, query block, rows, keys)
    # the keys in ring.py's block layout, skewed per rank: padded keys are the added -inf column
    bias = F.pad(bias, (0, 1), value=NEG_INF)
    index = _skewed_keys(block_positions(lengths, n), total, mesh, where_rows=bias.placements)
    bias = torch.gather(bias, 4, index.expand(*bias.shape[:4], -1)).unflatten(4, (n, -1))
    top = bias.amax(dim=(4, 5), keepdim=True)  # each query row's largest entry over every key
    live = top > NEG_INF
    bias = (bias - torch.where(live, top, 0.0)).clamp_min(torch.finfo(q.dtype).min).to(q.dtype)
    steps = []
    for t in range(n):
        step = _blocks_layout(bias[:, :, :, :, t].expand(batch, -1, -1, -1, -1), outer, inner)
        steps.append(step.redistribute(mesh, _kernel_placements(q, step.shape[HEADS] > 1)).flatten(0, 2).contiguous())
    return steps, _blocks_layout(live.squeeze(-1), outer, inner)


def _blocks_layout(x, outer: int, inner: int):
    """(batch or 1, heads or 1, query block, rows, ...) -> ring.py's (outer, query block, inner,
    heads, rows, ...) (outer and inner 1 where the batch is)."""
    x = x.unflatten(0, (outer, inner) if x.shape[0] > 1 else (1, 1))
    return x.permute(0, 3, 1, 2, *range(4, x.ndim))


def _mask_placements(q, shape, row_dim) -> list:
    """Placements of a (batch, heads, ...) mask tensor of ``shape`` for the query blocks ``q``:
    the batch (outer and inner) and heads shards of ``q`` where the mask has those dims (else
    they broadcast: Replicate), and ``q``'s block shard (over "sp") on ``row_dim``, the dim of
    the mask that holds the query rows or blocks (None: not sharded there)."""
    out = []
    for p in q.placements:
        if (p == Shard(0) or p == Shard(2)) and shape[0] > 1:
            out.append(Shard(0))
        elif p == Shard(BLOCK) and row_dim is not None:
            out.append(Shard(row_dim))
        elif p == Shard(HEADS) and shape[1] > 1:
            out.append(Shard(1))
        else:
            out.append(Replicate())
    return out


def _kernel_placements(q, has_heads: bool) -> list:
    """Placements of a step's bias (q's three leading dims, heads, rows, keys) before its leading
    dims merge: q's shards of those dims, and its heads shard where the mask has heads."""
    return [p if p in (Shard(0), Shard(BLOCK), Shard(2)) or (p == Shard(HEADS) and has_heads) else Replicate()
            for p in q.placements]


def _rows(mask, start: int, length: int):
    """Rows ``start:start + length`` of a (batch, heads, queries, keys) mask (a view)."""
    return mask.narrow(2, start, length)


def _placed(mask, mesh, placements):
    """``mask`` laid out as ``placements``: a plain tensor sends each rank only its part."""
    if isinstance(mask, dt.DTensor):
        if mask.device_mesh != mesh:
            raise ValueError("the attention mask is a DTensor of another mesh than the attention's inputs")
        return mask.redistribute(mesh, placements)
    return dt.distribute_tensor(mask, mesh, placements)


def _skewed_keys(positions, total: int, mesh, where_rows) -> object:
    """(1, 1, n, 1, n * key block) int64, sharded on its query-block dim as the bias rows are:
    for rank i the joint-sequence positions of key blocks i, i + 1, ... (mod n), the order in
    which the ring brings them; ``total`` (the added -inf column) on padding."""
    n = positions.shape[0]
    slots = torch.where(positions >= 0, positions, total)
    index = torch.stack([slots.roll(-i, 0).flatten() for i in range(n)])[None, None, :, None, :]
    return dt.distribute_tensor(index, mesh, [Shard(2) if p == Shard(2) else Replicate() for p in where_rows])


def _broadcast_4d(mask, batch: int, heads: int, total: int):
    """``mask`` as (batch or 1, heads or 1, total or 1, total), as scaled_dot_product_attention
    broadcasts it (right-aligned; a view)."""
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
