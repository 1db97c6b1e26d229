"""The VAE family: diffusers' ``AutoencoderKL`` (the SD3 and Flux pipelines' VAE), the class
unmodified.

Replicated first: every parameter is replicated on the whole mesh, and the only dim it uses is
``"dp"``: the images (``encode``) and the latents (``decode``) enter as Shard(0), the batch,
where they first meet the model (the ``encoder``, and ``post_quant_conv`` or the ``decoder``
where there is none), so ``encode``, ``decode`` and ``forward`` are all split. Every op of the
model keeps a batch shard as a local call (dtorch_core's convolution, group norm, nearest
upsampling and attention rules), uneven and empty shards included; the outputs (the latent
distribution's mean and log-variance, the decoded sample) stay batch-split.

Not served: "tp" (a convolution net has no heads to split; its channel shards would need a
gather per group norm), and spatially split decode over "sp" (each convolution would need its
neighbours' rows: halo exchange dtorch_core does not plan yet).
"""

from __future__ import annotations

from torch import nn

from ..family import ModelFamily

REFUSED = {
    "tp": "AutoencoderKL is served replicated, with the batch split over 'dp'; tensor parallel is not supported for it",
    "sp": "spatially split VAE decode is not supported yet",
    "cfg": "a pipeline decodes the guided latents only, after the CFG halves are combined: use 'dp' for a batch",
}


def vae_tp_plan(model: nn.Module) -> dict:
    return {}


VAE_FAMILY = ModelFamily(
    name="vae",
    model_classes=("AutoencoderKL",),
    dims=frozenset({"dp"}),
    tp_plan=vae_tp_plan,
    refused=REFUSED,
    # the images enter the encoder, the latents post_quant_conv (or the decoder, in a config
    # without it); a DTensor already split passes the later hooks unchanged
    batch_modules=("encoder", "post_quant_conv", "decoder"),
    batch_kwargs=("sample",),
)
