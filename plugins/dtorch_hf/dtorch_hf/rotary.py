"""Flux's rotary embedding as one op: ``dtorch_hf::rotary`` and its backward.

diffusers' ``apply_rotary_emb`` (real tables, pairs of adjacent channels) is about a dozen
elementwise ops and views on the query or key (reshape, unbind, neg, stack, flatten, two casts,
two products, a sum, a cast back), each a dispatch on the controller; Flux runs it twice per
attention. Here it is one op with the rule of the math: the query's batch, sequence (with the
tables' rows, uneven shards too) and heads dims may be split, the channels not (a pair must stay
on one rank). The workers run diffusers' own function on their shards, so the values are its
values; the backward is the rotation's adjoint, ``grad * cos - rot(grad * sin)`` in fp32 (rot:
(a, b) -> (-b, a) per channel pair). Tables that need gradients, plain tensors and autocast keep
diffusers' function.
"""

from __future__ import annotations

import torch

import dtorch_core as dt
from dtorch_core.placement import Partial, Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "DEF")
LIBRARY.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")
LIBRARY.define("rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor")


def rotary_kernel(x, cos, sin):
    """diffusers' apply_rotary_emb of a (batch, seq, heads, head_dim) ``x`` with (seq, head_dim)
    tables."""
    from diffusers.models.embeddings import apply_rotary_emb

    if x.numel() == 0:  # an empty shard (diffusers' reshape to (..., -1, 2) needs elements)
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


def rotary_backward_kernel(grad, cos, sin):
    grad32 = grad.float()
    scaled = grad32 * sin[None, :, None, :]
    first, second = scaled.reshape(*scaled.shape[:-1], scaled.shape[-1] // 2, 2).unbind(-1)
    rotated = torch.stack([-second, first], dim=-1).flatten(3)
    return (grad32 * cos[None, :, None, :] - rotated).to(grad.dtype)


LIBRARY.impl("rotary", rotary_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("rotary_backward", rotary_backward_kernel, "CompositeExplicitAutograd")
rotary_op = torch.ops.dtorch_hf.rotary.default
rotary_backward_op = torch.ops.dtorch_hf.rotary_backward.default


def rotary_strategies(call):
    """x (batch, seq, heads, head_dim), cos and sin (seq, head_dim) -> like x."""
    out = [Strategy((R, R, R), (R,)), Strategy((Shard(0), R, R), (Shard(0),)),
           Strategy((Shard(1), Shard(0), Shard(0)), (Shard(1),)), Strategy((Shard(2), R, R), (Shard(2),))]
    for kind in ("sum", "avg"):  # linear in x
        out.append(Strategy((Partial(kind), R, R), (Partial(kind),)))
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary_op(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable ops, so a second backward works
            return rotary_backward_kernel(grad, cos, sin), None, None
        return rotary_backward_op(grad, cos, sin), None, None


def rotary(x, freqs_cis):
    """``apply_rotary_emb(x, freqs_cis, sequence_dim=1)``; on a distributed ``x`` one op."""
    cos, sin = freqs_cis
    if type(x) is not dt.DTensor or cos.requires_grad or sin.requires_grad \
            or torch.is_autocast_enabled(x.device.type):
        from diffusers.models.embeddings import apply_rotary_emb

        return apply_rotary_emb(x, freqs_cis, sequence_dim=1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotary.apply(x, cos, sin)
    return rotary_op(x, cos, sin)


def register(registry) -> None:
    registry.add(rotary_op, Rule(rotary_strategies, kernel="dtorch_hf::rotary"))
    registry.add(rotary_backward_op, Rule(rotary_strategies, kernel="dtorch_hf::rotary_backward"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::rotary", rotary_kernel)
    registry.add("dtorch_hf::rotary_backward", rotary_backward_kernel)
