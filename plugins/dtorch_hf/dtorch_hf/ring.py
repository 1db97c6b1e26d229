"""Ring attention over the "sp" mesh dim: exact joint attention of sequence-sharded streams
without any rank holding the whole sequence's keys and values.

Every stream (Flux/SD3: text and image, or one joint stream) arrives as (batch, seq, heads,
head_dim) sharded on the sequence over the sp mesh dim, uneven lengths allowed (torch.chunk's
layout). Each stream is padded at its end to ``n * ceil(seq / n)`` (each rank pads its own shard:
no data moves, see dtorch_core's constant_pad rule), and laid out as ``n`` blocks along a leading
dim: rank i holds block i, the streams' blocks side by side, in the (batch, heads, tokens,
head_dim) layout of the attention kernels with batch and block as one leading dim (see
:func:`block_first` for their order: the one whose merge keeps every rank's blocks one
contiguous run, so no layout of it gathers). Then ``n``
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

from .ring_mask import RingMask, block_positions

aten = torch.ops.aten
SP_MODE_ATTR = "dtorch_sp_mode"
SEQ = 1  # (batch, sequence, heads, head_dim): diffusers' attention layout


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
    order = (1, 0) if block_first(queries[0], mesh_dim) else (0, 1)
    q, k, v = (torch.cat([_to_blocks(t, n, order) for t in ts], dim=3) for ts in (queries, keys, values))
    block_dim = order.index(1)
    if attn_mask is None:
        biases = _key_biases(block_positions(lengths, n), block_dim, q, mesh)
        live = None
    else:
        mask = attn_mask if isinstance(attn_mask, RingMask) else RingMask(attn_mask)
        biases, live = mask.biases(lengths, q, block_dim)
    out = _RingAttention.apply(q, k, v, biases, scale, block_dim)
    if live is not None:
        out = torch.where(live, out, 0.0)  # rows with nothing to attend to: SDPA's 0
    return [_from_blocks(o, s, order) for o, s in zip(out.split(blocks, dim=3), lengths)]


def block_first(x, mesh_dim: int) -> bool:
    """Whether the kernels' leading dim is (block, batch) rather than (batch, block), for a
    (batch, seq, heads, dim) ``x`` sharded on the sequence over ``mesh_dim``. The kernels merge
    the two dims, and dtorch_core keeps the merge sharded only where every rank's part of it is
    one contiguous run. The block dim has one block per rank, so (block, batch) gives rank i
    the run [i * batch, (i + 1) * batch): whole for any batch, and nested as dtorch_core nests
    shards (in mesh-dim order) where a later mesh dim splits the batch. Where a mesh dim before
    the "sp" one splits the batch ("cfg" first), the nesting wants (batch, block), contiguous
    where each rank holds one batch row; with more rows per rank neither order is one run per
    rank (that needs a strided placement dtorch_core does not have), and the merge gathers."""
    mesh = x.device_mesh
    return not any(p == Shard(0) and mesh.size(i) > 1 for i, p in enumerate(x.placements[:mesh_dim]))


def _to_blocks(x, n: int, order: tuple):
    """(batch, seq, heads, dim) -> (batch, n, heads, ceil(seq / n), dim), its first two dims in
    ``order`` ((1, 0): block first): block i is shard i."""
    length = x.shape[SEQ]
    padded = n * -(-length // n)
    x = F.pad(x, (0, 0, 0, 0, 0, padded - length))
    return x.unflatten(SEQ, (n, padded // n)).permute(*order, 3, 2, 4)


def _from_blocks(x, length: int, order: tuple):
    """The inverse of :func:`_to_blocks`."""
    x = x.permute(*order, 3, 2, 4).flatten(1, 2)
    return F.pad(x, (0, 0, 0, 0, 0, length - x.shape[SEQ]))


def merged_placements(x) -> list:
    """Placements of ``x``'s first two dims merged into one (the kernels' leading dim), its
    other dims dropped: where :func:`block_first` chose the order, a shard of either dim is a
    shard of the merge."""
    return [Shard(0) if p == Shard(0) or p == Shard(1) else Replicate() for p in x.placements]


def _key_biases(positions, block_dim: int, q, mesh) -> list | None:
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
        rolled = bias.roll(-step, 0)[:, None, None, None, :]  # rank i holds block i + step
        full = rolled.movedim(0, block_dim).expand(*q.shape[:2], 1, 1, bias.shape[1]).flatten(0, 1).contiguous()
        out.append(dt.distribute_tensor(full, mesh, where))
    return out


def _pass_on(x, block_dim: int):
    """``x`` (k/v, then the blocks' leading dims, ...) with every rank holding its neighbour's
    block (rank i gets rank i + 1's): one shift."""
    return torch.roll(x, -1, 1 + block_dim)


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
    """Attention of query blocks (the blocks' two leading dims, heads, L, dim) against every
    key/value block, passed round the ring along ``block_dim``; forward and backward as the
    module docstring says. The kernels see the two leading dims as one."""

    @staticmethod
    def forward(ctx, q, k, v, biases, scale, block_dim):
        n = q.shape[block_dim]
        flat_q = q.flatten(0, 1)
        kv = torch.stack([k, v])
        out = lse = None
        needs_grad = any(ctx.needs_input_grad[:3])
        for step in range(n):
            bias = None if biases is None else biases[step]
            part, part_lse, state = _attend(flat_q, kv[0].flatten(0, 1), kv[1].flatten(0, 1), bias, scale, needs_grad)
            part = part.float()
            if out is None:
                out, lse = part, part_lse
            else:
                merged = torch.logaddexp(lse, part_lse)
                out = out * torch.exp(lse - merged).unsqueeze(-1) + part * torch.exp(part_lse - merged).unsqueeze(-1)
                lse = merged
            if step < n - 1:
                kv = _pass_on(kv, block_dim)
        out = out.to(q.dtype)
        ctx.save_for_backward(flat_q, k, v, out, lse)
        ctx.biases, ctx.scale, ctx.kernel_state, ctx.block_dim = biases, scale, state, block_dim
        return out.unflatten(0, tuple(q.shape[:2]))

    @staticmethod
    def backward(ctx, grad_out):
        flat_q, k, v, out, lse = ctx.saved_tensors
        block_dim = ctx.block_dim
        n = k.shape[block_dim]
        kv = torch.stack([k, v])
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)
        grad_q = None
        grad_out = grad_out.flatten(0, 1).contiguous()
        lse = _kernel_lse(lse, ctx.kernel_state)
        for step in range(n):
            bias = None if ctx.biases is None else ctx.biases[step]
            gq, gk, gv = _attend_backward(grad_out, flat_q, kv[0].flatten(0, 1), kv[1].flatten(0, 1), bias, out, lse,
                                          ctx.kernel_state, ctx.scale)
            grad_q = gq.float() if grad_q is None else grad_q + gq.float()
            grad_kv = grad_kv + torch.stack([gk, gv]).unflatten(1, tuple(k.shape[:2])).float()
            if step < n - 1:
                kv = _pass_on(kv, block_dim)
            grad_kv = _pass_on(grad_kv, block_dim)  # the last pass brings each block's gradient home
        grad_q = grad_q.to(flat_q.dtype).unflatten(0, tuple(k.shape[:2]))
        return grad_q, grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None
