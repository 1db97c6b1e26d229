"""Flux's rotary tables as one op: ``dtorch_hf::flux_pos_embed``.

diffusers' ``FluxPosEmbed`` turns the (tokens, axes) position ids into the (tokens, channels) cos
and sin tables every forward: per axis an ``arange`` on the ids' device, a power, an outer product,
cos, sin, ``repeat_interleave``, then a ``cat`` of the axes; about 40 ops. On a distributed model
each is a dispatch on the controller, and the ``arange`` tensors are plain tensors made on the
controller's own device that then meet the distributed ids (a host copy and, on a GPU, a sync of
the controller's stream each). A pipeline passes the ids as plain tensors, so the tables came out
plain too, and every attention's rotary embedding sent both tables to the workers again.

Here the tables are one op, run by the workers with diffusers' own module on their rows of the ids,
so the values are its values: ids replicated give replicated tables, ids split over the tokens
give the same split of the tables' rows (uneven too). Plain ids reaching a distributed model are
first distributed, replicated on the model's mesh (``distributed_pos_embed``), so the tables stay
on the workers for every block of the step.
"""

from __future__ import annotations

import torch

from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

from .batch import as_given, one_op_forward

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("flux_pos_embed(Tensor ids, int[] axes_dim, float theta) -> (Tensor, Tensor)")


def flux_pos_embed_kernel(ids, axes_dim, theta):
    """diffusers' ``FluxPosEmbed(theta, axes_dim)(ids)`` of (tokens, axes) ``ids``: (cos, sin)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    return FluxPosEmbed(theta=as_given(theta), axes_dim=list(axes_dim))(ids)


LIBRARY.impl("flux_pos_embed", flux_pos_embed_kernel, "CompositeExplicitAutograd")
flux_pos_embed_op = torch.ops.dtorch_hf.flux_pos_embed.default


def flux_pos_embed_strategies(call):
    """ids (tokens, axes) -> cos, sin (tokens, channels): rows follow the ids' rows."""
    return [Strategy((R,), (R, R)), Strategy((Shard(0),), (Shard(0), Shard(0)))]


def distributed_pos_embed(pos_embed, weight):
    """A forward for the ``FluxPosEmbed`` ``pos_embed`` of a model whose parameter ``weight()``
    says where it is: the one op while that is a DTensor (``batch.one_op_forward``)."""
    return one_op_forward(pos_embed.forward, weight, 2, lambda ids: flux_pos_embed_op(
        ids, list(pos_embed.axes_dim), float(pos_embed.theta)))


def register(registry) -> None:
    registry.add(flux_pos_embed_op, Rule(flux_pos_embed_strategies, kernel="dtorch_hf::flux_pos_embed"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::flux_pos_embed", flux_pos_embed_kernel)
