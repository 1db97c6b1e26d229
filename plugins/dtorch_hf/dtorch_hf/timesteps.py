"""diffusers' sinusoidal timestep embedding as one op: ``dtorch_hf::timestep_embedding``.

``Timesteps`` (Flux's and SD3's ``time_text_embed.time_proj``, Flux's guidance too) calls
``get_timestep_embedding``: an ``arange`` on the timesteps' device, exp, an outer product, sin,
cos, a ``cat`` and a flip; about ten ops a call. On a distributed model each is a dispatch on the
controller, and the ``arange`` is a plain tensor made on the controller's own device that then
meets the distributed timesteps (a host copy, and on a GPU a sync of the controller's stream).

Here it is one op the workers run with diffusers' own function on their timesteps, so the values
are its values: replicated timesteps give a replicated embedding, timesteps split over the batch
("cfg", "dp") the same split of its rows. Plain 1-D timesteps reaching a distributed model are
distributed first, replicated on its mesh.
"""

from __future__ import annotations

import torch

from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

from .batch import as_given, one_op_forward

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("timestep_embedding(Tensor timesteps, int embedding_dim, bool flip_sin_to_cos, "
               "float downscale_freq_shift, float scale) -> Tensor")


def timestep_embedding_kernel(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale):
    """diffusers' ``get_timestep_embedding`` of 1-D ``timesteps``: (N, embedding_dim)."""
    from diffusers.models.embeddings import get_timestep_embedding

    return get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=flip_sin_to_cos,
                                  downscale_freq_shift=as_given(downscale_freq_shift), scale=as_given(scale))


LIBRARY.impl("timestep_embedding", timestep_embedding_kernel, "CompositeExplicitAutograd")
timestep_embedding_op = torch.ops.dtorch_hf.timestep_embedding.default


def timestep_embedding_strategies(call):
    """timesteps (N,) -> (N, channels): rows follow the timesteps."""
    return [Strategy((R,), (R,)), Strategy((Shard(0),), (Shard(0),))]


def distributed_timesteps(module, weight):
    """A forward for diffusers' ``Timesteps`` ``module`` in a model whose parameter ``weight()``
    says where it is: the one op while that is a DTensor (``batch.one_op_forward``)."""
    return one_op_forward(module.forward, weight, 1, lambda timesteps: timestep_embedding_op(
        timesteps, module.num_channels, bool(module.flip_sin_to_cos), float(module.downscale_freq_shift),
        float(module.scale)))


def one_op_timesteps(model, weight) -> None:
    """Give every ``Timesteps`` module of ``model`` the one-op forward."""
    from diffusers.models.embeddings import Timesteps

    for module in model.modules():
        if type(module) is Timesteps:
            module.forward = distributed_timesteps(module, weight)


def register(registry) -> None:
    registry.add(timestep_embedding_op, Rule(timestep_embedding_strategies, kernel="dtorch_hf::timestep_embedding"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::timestep_embedding", timestep_embedding_kernel)
