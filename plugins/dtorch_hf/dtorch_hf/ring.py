"""Ring attention over the "sp" mesh dim: exact joint attention of sequence-sharded streams
without any rank holding the whole sequence's keys and values.

Every stream (Flux/SD3: text and image, or one joint stream) arrives as (batch, seq, heads,
head_dim) sharded on the sequence over the sp mesh dim, uneven lengths allowed (torch.chunk's
layout). Each stream is padded at its end to ``n * ceil(seq / n)`` (each rank pads its own shard:
no data moves, see dtorch_core's constant_pad rule), and laid out as ``n`` blocks: rank i holds block i, the streams' blocks side by side, in the
(batch, heads, tokens, head_dim) layout of the attention kernels with the batch and the block as
three leading dims, (outer, block, inner), which the kernels see as one (see :func:`batch_outer`:
the batch is split into the part the mesh dims before "sp" shard and the rest, so that the
merge keeps every rank's rows one contiguous run and no layout of it gathers). Then ``n``
steps: each rank attends its query block to the key/value block it holds (a kernel that returns
the log-sum-exp: :func:`_attend`), merges the partial output with the running one through the
log-sum-exp (online softmax, in fp32), and the key/value blocks move one rank round the ring (a
``torch.roll`` by one block, which dtorch_core plans as one ``shift`` collective: each rank sends
one block to its neighbour and receives one). Padded keys are masked with an additive bias;
padded queries are cropped at the end. Keys and values are never gathered. An attention mask
(``attn_mask``) replaces that bias by the mask's block for each step, laid out on the workers
(dtorch_hf/ring_mask.py); the rows it masks at every key are set to 0 at the end, as SDPA does.

Backward (:class:`_RingAttention`) is the ring again: the key/value blocks travel with their
gradient accumulators, each step adds the kernel's gradient of the local queries against
the visiting block (computed from the final output and log-sum-exp, so each block's share is
exact), and after ``n`` steps the accumulators are home.

Kernels, by the tensors' device: on the CPU the flash kernel (it takes a broadcast bias), on CUDA
the memory-efficient one (CUDA's flash kernel takes no bias; this one takes it only in the full
(batch, heads, queries, keys) shape, so the bias is expanded, a view; its log-sum-exp is padded
to a multiple of 32 queries, so it is cropped for the merge and padded back for the backward).

Heads split over "tp" stay split: the block layout keeps the heads dim, and every kernel runs on
the local heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard

from .ring_mask import BLOCK, RingMask, block_positions

aten = torch.ops.aten
SP_MODE_ATTR = "dtorch_sp_mode"
SEQ = 1  # (batch, sequence, heads, head_dim): diffusers' attention layout
TOKENS = 4  # of the blocks' layout (ring_mask.BLOCK)
LEAD_SHARDS = (Shard(0), Shard(BLOCK), Shard(2))


def set_sp_mode(model, sp_mode: str) -> None:
    """Tell the attention modules of ``model`` (those with a diffusers ``processor``) which
    sequence-parallel mode ``dtorch_hf.parallelize`` chose; the families' processors read it."""
    for module in model.modules():
        if hasattr(module, "processor"):
            setattr(module, SP_MODE_ATTR, sp_mode)


def ring_mesh_dim(attn, query) -> int | None:
    """The mesh dim the ring runs over: ``query``'s "sp" dim that shards its sequence, when
    ``attn`` was parallelized with sp_mode="ring"; else None (the caller runs Ulysses or plain
    attention)."""
    if getattr(attn, SP_MODE_ATTR, "ulysses") != "ring" or not isinstance(query, dt.DTensor):
        return None
    names = query.device_mesh.mesh_dim_names or ()
    for i, name in enumerate(names):
        if name == "sp" and query.device_mesh.size(i) > 1 and query.placements[i] == Shard(SEQ):
            return i
    return None


def ring_attention(queries, keys, values, mesh_dim: int, scale: float | None = None, attn_mask=None) -> list:
    """Joint attention of the streams (lists of (batch, seq, heads, head_dim) tensors, one per
    stream, each sequence-sharded on ``mesh_dim``): the queries of every stream attend to the
    keys of all of them. Returns one output per stream, laid out as its queries.

    ``attn_mask``: as scaled_dot_product_attention's (boolean, True = attend, or additive
    float), over the joint sequence (the streams concatenated in the order given), broadcastable
    to (batch, heads, queries, keys); a tensor, a DTensor of the same mesh, or either wrapped in
    a :class:`~dtorch_hf.ring_mask.RingMask` (laid out once for several calls). Each ring step
    applies the block of it that matches the key/value block a rank holds
    (dtorch_hf/ring_mask.py); rows masked at every key give 0, as SDPA does. It gets no
    gradient."""
    mesh = queries[0].device_mesh
    if queries[0].device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"dtorch_hf's ring attention has kernels for CPU and CUDA tensors, not {queries[0].device.type}; "
            "use sp_mode='ulysses'")
    n = mesh.size(mesh_dim)
    lengths = [q.shape[SEQ] for q in queries]
    blocks = [-(-s // n) for s in lengths]
    batch = queries[0].shape[0]
    padded = _padded_batch(queries[0], mesh_dim)
    if padded != batch:  # rows of zeros at the end, on the ranks that hold fewer: nothing moves
        queries, keys, values = ([_pad_batch(t, padded) for t in ts] for ts in (queries, keys, values))
        if attn_mask is not None:
            attn_mask = (attn_mask if isinstance(attn_mask, RingMask) else RingMask(attn_mask)).for_batch(padded)
    outer = batch_outer(queries[0], mesh_dim)
    q, k, v = (torch.cat([_to_blocks(t, n, outer) for t in ts], dim=TOKENS) for ts in (queries, keys, values))
    if attn_mask is None:
        biases = _key_biases(block_positions(lengths, n), q, mesh)
        live = None
    else:
        mask = attn_mask if isinstance(attn_mask, RingMask) else RingMask(attn_mask)
        biases, live = mask.biases(lengths, q)
    out = _RingAttention.apply(q, k, v, biases, scale)
    if live is not None:
        out = torch.where(live, out, 0.0)  # rows with nothing to attend to: SDPA's 0
    return [_pad_batch(_from_blocks(o, s), batch) for o, s in zip(out.split(blocks, dim=TOKENS), lengths)]


def _padded_batch(x, mesh_dim: int) -> int:
    """The batch the ring runs on: ``x``'s, or where one mesh dim before ``mesh_dim`` ("sp")
    splits it unevenly (3 rows on "dp" or "cfg" of 2) and nothing else splits it, that batch
    padded to the next multiple of its size. torch.chunk's layout of the padded batch keeps every
    row on its rank (each part is ``ceil(batch / size)`` long either way), so the pad and the crop
    after it are local, and the ring's (outer, block, inner) layout then holds (a mask with a batch dim is padded with it:
    RingMask.for_batch). Where several mesh dims split the batch unevenly, padding would move
    rows between ranks: the batch stays as it is, and its merge gathers (:func:`batch_outer`)."""
    batch = x.shape[0]
    splits = [i for i, p in enumerate(x.placements) if p == Shard(0)]
    if len(splits) != 1 or splits[0] > mesh_dim:  # a dim after "sp" splits the inner rows: no gather
        return batch
    size = x.device_mesh.size(splits[0])
    return batch if batch % size == 0 else size * -(-batch // size)


def _pad_batch(x, batch: int):
    """``x`` with its batch (dim 0) padded with zeros, or cropped, to ``batch`` rows at its end."""
    if x.shape[0] == batch:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, batch - x.shape[0]))


def batch_outer(x, mesh_dim: int) -> int:
    """How many parts the mesh dims before ``mesh_dim`` ("sp") cut the batch of ``x`` into (1
    where none splits it; the whole batch where they split it unevenly).

    The kernels merge the leading dims (outer, block, inner) into one, and dtorch_core keeps the
    merge sharded only where every rank's part of it is one contiguous run; it nests shards in
    mesh-dim order. Rank i of "sp" holds block i, so with the batch cut into ``outer`` parts
    (one per rank of the mesh dims before "sp", "cfg" first) and ``inner`` rows each, rank (c, i)
    holds the run [(c * n + i) * inner, (c * n + i + 1) * inner): contiguous for any batch,
    nested further where a mesh dim after "sp" splits the inner rows. Where the dims before "sp"
    split the batch unevenly there is no such cut: outer is then the batch (one row per part),
    and a rank holding several rows holds several runs, so the merge gathers. (:func:`ring_attention`
    pads a batch that one mesh dim splits unevenly first, :func:`_padded_batch`.)"""
    mesh = x.device_mesh
    outer = 1
    for i, p in enumerate(x.placements[:mesh_dim]):
        if p == Shard(0):
            outer *= mesh.size(i)
    return outer if x.shape[0] % outer == 0 else x.shape[0]


def _to_blocks(x, n: int, outer: int):
    """(batch, seq, heads, dim) -> (outer, n, batch / outer, heads, ceil(seq / n), dim): block i
    is shard i."""
    batch, length = x.shape[0], x.shape[SEQ]
    padded = n * -(-length // n)
    x = F.pad(x, (0, 0, 0, 0, 0, padded - length))
    return x.view(outer, batch // outer, n, padded // n, *x.shape[2:]).permute(0, 2, 1, 4, 3, 5)


def _from_blocks(x, length: int):
    """The inverse of :func:`_to_blocks`."""
    x = x.permute(0, 2, 1, 4, 3, 5).flatten(2, 3).flatten(0, 1)
    return F.pad(x, (0, 0, 0, 0, 0, length - x.shape[SEQ]))


def merged_placements(x) -> list:
    """Placements of the blocks' three leading dims merged into one (the kernels' leading dim),
    ``x``'s other dims dropped: with the batch cut as :func:`batch_outer` cuts it, a shard of any
    of them is a shard of the merge."""
    return [Shard(0) if p in LEAD_SHARDS else Replicate() for p in x.placements]


def _key_biases(positions, q, mesh) -> list | None:
    """Per ring step, the additive key bias (the kernels' leading dim, 1, 1, keys) of the key
    blocks each rank holds then (0 on real keys, the dtype's minimum on padding; finite, so a
    block of padding alone gives a log-sum-exp that the merge weighs to zero), laid out as the
    kernels' leading dim; None where nothing is padded. ``positions``:
    ring_mask.block_positions. Built on the controller: it depends on the shapes alone (a
    constant under dt.compile)."""
    valid = positions >= 0
    if bool(valid.all()):
        return None
    n = valid.shape[0]
    bias = torch.zeros(valid.shape, dtype=q.dtype).masked_fill(~valid, torch.finfo(q.dtype).min)
    where = merged_placements(q)
    out = []
    for step in range(n):
        rolled = bias.roll(-step, 0)[None, :, None, None, None, :]  # rank i holds block i + step
        full = rolled.expand(q.shape[0], n, q.shape[2], 1, 1, bias.shape[1]).flatten(0, 2).contiguous()
        out.append(dt.distribute_tensor(full, mesh, where))
    return out


def _pass_on(x):
    """``x`` (k/v, then the blocks' layout) with every rank holding its neighbour's block (rank
    i gets rank i + 1's): one shift."""
    return torch.roll(x, -1, 1 + BLOCK)


def _attend(q, k, v, bias, scale, needs_grad=True):
    """Attention of query blocks to key/value blocks ((batch, heads, tokens, dim)): the output,
    its fp32 log-sum-exp (batch, heads, queries), and what :func:`_attend_backward` needs besides
    (CUDA: the RNG state, unused without dropout, and the kernel's log-sum-exp width).

    Without a gradient to come, unpadded fp16/bf16 CUDA blocks go through aten's flash op (no
    bias, an exact log-sum-exp): the op an attention-kernel plugin (dtorch_sage_attn) serves for
    inference; inside this autograd.Function grad mode is off, so the op, not grad mode, is what
    tells inference from training."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse, None
    if not needs_grad and bias is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return out, lse, None
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, _full_bias(bias, q, k), True, 0.0, False, scale=scale)
    return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])


def _attend_backward(grad_out, q, k, v, bias, out, lse, state, scale):
    """Gradients of :func:`_attend` for query, key and value, from the final (merged) output and
    log-sum-exp: each key/value block's exact share."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    seed, offset, _ = state
    grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, _full_bias(bias, q, k), out, lse, seed, offset, 0.0, [True, True, True, False],
        False, scale=scale)
    return grad_q, grad_k, grad_v


def _kernel_lse(lse, state):
    """The merged log-sum-exp as the backward kernel reads it: CUDA's padded to the width its
    forward returned (the padding is never read as a query's)."""
    return lse if state is None else F.pad(lse, (0, state[2] - lse.shape[-1]))


def _full_bias(bias, q, k):
    """The (batch, 1, 1, keys) key bias as the (batch, heads, queries, keys) view CUDA's
    memory-efficient kernel checks for (dtorch_core's kernel pads its rows to the alignment)."""
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


class _RingAttention(torch.autograd.Function):
    """Attention of query blocks (the blocks' layout: three leading dims, heads, L, dim) against
    every key/value block, passed round the ring along the block dim; forward and backward as
    the module docstring says. The kernels see the three leading dims as one."""

    @staticmethod
    def forward(ctx, q, k, v, biases, scale):
        n = q.shape[BLOCK]
        flat_q = q.flatten(0, 2)
        kv = torch.stack([k, v])
        out = lse = None
        needs_grad = any(ctx.needs_input_grad[:3])
        for step in range(n):
            bias = None if biases is None else biases[step]
            part, part_lse, state = _attend(flat_q, kv[0].flatten(0, 2), kv[1].flatten(0, 2), bias, scale, needs_grad)
            part = part.float()
            if out is None:
                out, lse = part, part_lse
            else:
                merged = torch.logaddexp(lse, part_lse)
                out = out * torch.exp(lse - merged).unsqueeze(-1) + part * torch.exp(part_lse - merged).unsqueeze(-1)
                lse = merged
            if step < n - 1:
                kv = _pass_on(kv)
        out = out.to(q.dtype)
        ctx.save_for_backward(flat_q, k, v, out, lse)
        ctx.biases, ctx.scale, ctx.kernel_state = biases, scale, state
        return out.unflatten(0, tuple(q.shape[:3]))

    @staticmethod
    def backward(ctx, grad_out):
        flat_q, k, v, out, lse = ctx.saved_tensors
        n = k.shape[BLOCK]
        kv = torch.stack([k, v])
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)
        grad_q = None
        grad_out = grad_out.flatten(0, 2).contiguous()
        lse = _kernel_lse(lse, ctx.kernel_state)
        for step in range(n):
            bias = None if ctx.biases is None else ctx.biases[step]
            gq, gk, gv = _attend_backward(grad_out, flat_q, kv[0].flatten(0, 2), kv[1].flatten(0, 2), bias, out, lse,
                                          ctx.kernel_state, ctx.scale)
            grad_q = gq.float() if grad_q is None else grad_q + gq.float()
            grad_kv = grad_kv + torch.stack([gk, gv]).unflatten(1, tuple(k.shape[:3])).float()
            if step < n - 1:
                kv = _pass_on(kv)
            grad_kv = _pass_on(grad_kv)  # the last pass brings each block's gradient home
        grad_q = grad_q.to(flat_q.dtype).unflatten(0, tuple(k.shape[:3]))
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None
