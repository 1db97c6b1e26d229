"""adaLN-Zero's modulated layer norm as one op: ``dtorch_hf::norm_modulate``.

diffusers' ``AdaLayerNormZero`` (SD3's and Flux's double blocks, image and text stream) and
``AdaLayerNormZeroSingle`` (Flux's single blocks) end with ``norm(x) * (1 + scale[:, None]) +
shift[:, None]``: a layer norm without affine, two unsqueezes, an add, a multiply and an add, six
dispatches on the controller per call. In inference (no gradient to come) a distributed model runs
them as one op whose kernel is that expression on each worker's shard, so the values are diffusers'
values; the modulation's Linear and its ``chunk`` stay as they are. The rule follows the maths: the
batch may be split (with the rows of shift and scale), the sequence too (shift and scale replicated);
the features the norm runs over never. With gradients, autocast, plain tensors, or a norm that is not
a plain ``nn.LayerNorm`` without affine, diffusers' own forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("norm_modulate(Tensor x, Tensor shift, Tensor scale, float eps) -> Tensor")


def norm_modulate_kernel(x, shift, scale, eps):
    """``layer_norm(x) * (1 + scale[:, None]) + shift[:, None]`` of (batch, seq, features) ``x``
    and (batch, features) ``shift`` and ``scale``: diffusers' adaLN-Zero expression."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


LIBRARY.impl("norm_modulate", norm_modulate_kernel, "CompositeExplicitAutograd")
norm_modulate_op = torch.ops.dtorch_hf.norm_modulate.default


def norm_modulate_strategies(call):
    """x (batch, seq, features), shift and scale (batch, features) -> like x."""
    return [Strategy((R, R, R), (R,)), Strategy((Shard(0), Shard(0), Shard(0)), (Shard(0),)),
            Strategy((Shard(1), R, R), (Shard(1),))]


def modulated_forward(module, chunks: int):
    """A forward for an ``AdaLayerNormZero`` (``chunks`` 6) or ``AdaLayerNormZeroSingle`` (3):
    diffusers' steps, with the modulated norm as one op where it applies."""
    original = module.forward
    emb_at = 3 if chunks == 6 else 0  # emb's place after x: (timestep, class_labels, hidden_dtype, emb)

    def forward(x, *args, **kwargs):
        norm = module.norm
        emb = kwargs.get("emb", args[emb_at] if len(args) > emb_at else None)
        others = list(args[:emb_at]) + [v for k, v in kwargs.items() if k != "emb"]
        if type(norm) is not nn.LayerNorm or norm.elementwise_affine or type(x) is not dt.DTensor or emb is None \
                or any(a is not None for a in others) or getattr(module, "emb", None) is not None \
                or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            return original(x, *args, **kwargs)  # a timestep/label embedding of its own, training...
        shift, scale, *rest = module.linear(module.silu(emb)).chunk(chunks, dim=1)
        return (norm_modulate_op(x, shift, scale, float(norm.eps)), *rest)

    return forward


def one_op_modulation(model) -> None:
    """Give every ``AdaLayerNormZero`` and ``AdaLayerNormZeroSingle`` of ``model`` the one-op forward."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    for module in model.modules():
        if type(module) is AdaLayerNormZero:
            module.forward = modulated_forward(module, 6)
        elif type(module) is AdaLayerNormZeroSingle:
            module.forward = modulated_forward(module, 3)


def register(registry) -> None:
    registry.add(norm_modulate_op, Rule(norm_modulate_strategies, kernel="dtorch_hf::norm_modulate"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::norm_modulate", norm_modulate_kernel)
