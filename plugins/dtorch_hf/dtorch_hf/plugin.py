"""The hook implementations of dtorch_hf (its entry point ``hf``): the families it serves, the
worker kernel that ``from_pretrained`` reads weights with, Flux's one-op rotary embedding and
rotary tables, and the one-op timestep embedding, adaLN-Zero modulation (modulated norm, gated
residual), RMSNorm and joint-attention layout of Flux and SD3, and T5's relative position bias."""

from __future__ import annotations

from dtorch_core import hookimpl

from . import joint, modulate, pos_embed, position_bias, rms_norm, rotary, timesteps
from .families.clip import CLIP_TEXT_FAMILY
from .families.flux import FLUX_FAMILY
from .families.sd3 import SD3_FAMILY
from .families.t5 import T5_FAMILY
from .families.vae import VAE_FAMILY
from .weights_kernel import register as register_weights_kernel


@hookimpl
def dtorch_register_model_families(registry) -> None:
    registry.add(T5_FAMILY.name, T5_FAMILY)
    registry.add(FLUX_FAMILY.name, FLUX_FAMILY)
    registry.add(SD3_FAMILY.name, SD3_FAMILY)
    registry.add(CLIP_TEXT_FAMILY.name, CLIP_TEXT_FAMILY)
    registry.add(VAE_FAMILY.name, VAE_FAMILY)


@hookimpl
def dtorch_register_ops(registry) -> None:
    rotary.register(registry)
    pos_embed.register(registry)
    timesteps.register(registry)
    modulate.register(registry)
    rms_norm.register(registry)
    joint.register(registry)
    position_bias.register(registry)


@hookimpl
def dtorch_register_kernels(registry) -> None:
    register_weights_kernel(registry)
    rotary.register_kernels(registry)
    pos_embed.register_kernels(registry)
    timesteps.register_kernels(registry)
    modulate.register_kernels(registry)
    rms_norm.register_kernels(registry)
    joint.register_kernels(registry)
    position_bias.register_kernels(registry)
