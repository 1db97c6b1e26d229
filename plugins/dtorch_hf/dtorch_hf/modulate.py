"""adaLN-Zero's modulation as ops: the modulated layer norm ``dtorch_hf::norm_modulate`` and the
gated residual ``dtorch_hf::gated_add``.

diffusers' ``AdaLayerNormZero`` (SD3's and Flux's double blocks, image and text stream) and
``AdaLayerNormZeroSingle`` (Flux's single blocks) end with ``norm(x) * (1 + scale[:, None]) +
shift[:, None]``: a layer norm without affine, two unsqueezes, an add, a multiply and an add, six
dispatches on the controller per call. In inference (no gradient to come) a distributed model runs
them as one op whose kernel is that expression on each worker's shard, so the values are diffusers'
values; the modulation's Linear and its ``chunk`` stay as they are. The rule follows the maths: the
batch may be split (with the rows of shift and scale), the sequence too (shift and scale replicated);
the features the norm runs over never. With gradients, autocast, plain tensors, or a norm that is not
a plain ``nn.LayerNorm`` without affine, diffusers' own forward runs.

The blocks around those norms (dtorch_hf/blocks.py) use the same norm again after attention
(``norm2``: ``norm2(h) * (1 + scale[:, None]) + shift[:, None]``) and add every branch back
through its gate, ``h + gate.unsqueeze(1) * out`` (an unsqueeze, a multiply and an add):
``gated_add`` is that as one op, with the same rule (gate split with the batch, replicated
over the sequence).
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
LIBRARY.define("gated_add(Tensor x, Tensor gate, Tensor y) -> Tensor")


def norm_modulate_kernel(x, shift, scale, eps):
    """``layer_norm(x) * (1 + scale[:, None]) + shift[:, None]`` of (batch, seq, features) ``x``
    and (batch, features) ``shift`` and ``scale``: diffusers' adaLN-Zero expression."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


LIBRARY.impl("norm_modulate", norm_modulate_kernel, "CompositeExplicitAutograd")
norm_modulate_op = torch.ops.dtorch_hf.norm_modulate.default


def gated_add_kernel(x, gate, y):
    """``x + gate.unsqueeze(1) * y`` of (batch, seq, features) ``x`` and ``y`` and (batch,
    features) ``gate``: diffusers' gated residual."""
    return x + gate.unsqueeze(1) * y


LIBRARY.impl("gated_add", gated_add_kernel, "CompositeExplicitAutograd")
gated_add_op = torch.ops.dtorch_hf.gated_add.default


def norm_modulate_strategies(call):
    """x (batch, seq, features), shift and scale (batch, features) -> like x."""
    return [Strategy((R, R, R), (R,)), Strategy((Shard(0), Shard(0), Shard(0)), (Shard(0),)),
            Strategy((Shard(1), R, R), (Shard(1),))]


def gated_add_strategies(call):
    """x and y (batch, seq, features), gate (batch, features) -> like x."""
    return [Strategy((R, R, R), (R,)), Strategy((Shard(0), Shard(0), Shard(0)), (Shard(0),)),
            Strategy((Shard(1), R, Shard(1)), (Shard(1),))]


def one_op_applies(x) -> bool:
    """Whether adaLN-Zero's expressions run as one op for ``x``: a DTensor in inference (no
    gradient to come, no autocast); otherwise diffusers' own code runs."""
    return type(x) is dt.DTensor and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


def plain_norm(norm) -> bool:
    """Whether ``norm`` is what the modulated-norm kernel computes: an ``nn.LayerNorm`` without affine."""
    return type(norm) is nn.LayerNorm and not norm.elementwise_affine


def gated_residual(x, gate, y):
    """``x + gate.unsqueeze(1) * y``: one op where :func:`one_op_applies`, else diffusers' expression."""
    return gated_add_op(x, gate, y) if one_op_applies(x) else x + gate.unsqueeze(1) * y


def modulated_stream(x, branches, norm, shift, scale, gate, ff):
    """One stream of an adaLN-Zero block after attention: ``x`` plus each (gate, output) of
    ``branches`` through its gate, then plus ``gate`` times the feed-forward ``ff`` of the
    modulated ``norm`` of that sum; diffusers' order of operations (``one_op_applies`` held)."""
    for branch_gate, out in branches:
        x = gated_add_op(x, branch_gate, out)
    return gated_add_op(x, gate, ff(norm_modulate_op(x, shift, scale, float(norm.eps))))


class SharedSilu:
    """``silu(emb)`` once per model call. Every adaLN module of SD3 and Flux (two a double block,
    one a single block, ``norm_out``) applies its own stateless SiLU to the same ``temb``: the
    first computes it, the others reuse that tensor (the same values). Forgotten when the model's
    next call starts (:meth:`reset`, a forward pre-hook), so nothing outlives the call."""

    def __init__(self):
        self.emb = self.out = None

    def reset(self, *_) -> None:
        self.emb = self.out = None

    def __call__(self, silu, emb):
        if type(silu) is not nn.SiLU:
            return silu(emb)
        if emb is not self.emb:
            self.emb, self.out = emb, silu(emb)
        return self.out


def modulated_forward(module, chunks: int, shared: SharedSilu):
    """A forward for an ``AdaLayerNormZero`` (``chunks`` 6) or ``AdaLayerNormZeroSingle`` (3):
    diffusers' steps, with the modulated norm as one op where it applies."""
    original = module.forward
    emb_at = 3 if chunks == 6 else 0  # emb's place after x: (timestep, class_labels, hidden_dtype, emb)

    def forward(x, *args, **kwargs):
        norm = module.norm
        emb = kwargs.get("emb", args[emb_at] if len(args) > emb_at else None)
        others = list(args[:emb_at]) + [v for k, v in kwargs.items() if k != "emb"]
        if not plain_norm(norm) or not one_op_applies(x) or emb is None \
                or any(a is not None for a in others) or getattr(module, "emb", None) is not None:
            return original(x, *args, **kwargs)  # a timestep/label embedding of its own, training...
        shift, scale, *rest = module.linear(shared(module.silu, emb)).chunk(chunks, dim=1)
        return (norm_modulate_op(x, shift, scale, float(norm.eps)), *rest)

    return forward


def continuous_forward(module, shared: SharedSilu):
    """A forward for an ``AdaLayerNormContinuous`` (SD3's last context norm, both models'
    ``norm_out``): diffusers' steps, with ``norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]``
    (the same values as the kernel's expression) as one op where it applies."""
    original = module.forward

    def forward(x, conditioning_embedding):
        if not plain_norm(module.norm) or not one_op_applies(x):
            return original(x, conditioning_embedding)
        scale, shift = module.linear(shared(module.silu, conditioning_embedding).to(x.dtype)).chunk(2, dim=1)
        return norm_modulate_op(x, shift, scale, float(module.norm.eps))

    return forward


def dual_forward(module, shared: SharedSilu):
    """A forward for SD3.5's ``SD35AdaLayerNormZeroX`` (a block with a second attention): its
    two modulated norms of one norm as one op each where they apply."""
    original = module.forward

    def forward(hidden_states, emb=None):
        if not plain_norm(module.norm) or not one_op_applies(hidden_states) or emb is None:
            return original(hidden_states, emb)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2 = \
            module.linear(shared(module.silu, emb)).chunk(9, dim=1)
        eps = float(module.norm.eps)
        return (norm_modulate_op(hidden_states, shift, scale, eps), gate, shift_mlp, scale_mlp, gate_mlp,
                norm_modulate_op(hidden_states, shift2, scale2, eps), gate2)

    return forward


def one_op_modulation(model) -> None:
    """Give every ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``
    and ``SD35AdaLayerNormZeroX`` of ``model`` the one-op forward, sharing one SiLU of the
    conditioning embedding per call of ``model``."""
    from diffusers.models.normalization import (
        AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle, SD35AdaLayerNormZeroX)

    shared = SharedSilu()
    model.register_forward_pre_hook(shared.reset)
    for module in model.modules():
        if type(module) is AdaLayerNormZero:
            module.forward = modulated_forward(module, 6, shared)
        elif type(module) is AdaLayerNormZeroSingle:
            module.forward = modulated_forward(module, 3, shared)
        elif type(module) is AdaLayerNormContinuous:
            module.forward = continuous_forward(module, shared)
        elif type(module) is SD35AdaLayerNormZeroX:
            module.forward = dual_forward(module, shared)


def register(registry) -> None:
    registry.add(norm_modulate_op, Rule(norm_modulate_strategies, kernel="dtorch_hf::norm_modulate"))
    registry.add(gated_add_op, Rule(gated_add_strategies, kernel="dtorch_hf::gated_add"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::norm_modulate", norm_modulate_kernel)
    registry.add("dtorch_hf::gated_add", gated_add_kernel)
