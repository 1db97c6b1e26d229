"""diffusers' ``RMSNorm`` as one op: ``dtorch_hf::rms_norm``.

Flux's attentions (and SD3.5's) normalise q and k per head with diffusers' ``RMSNorm``, which
computes in fp32 through a cast, a square, a mean, an add, an rsqrt, a product, a cast back and
the weight's product: eight dispatches on the controller per call, four calls per double block.
In inference (no gradient to come) a distributed model runs it as one op whose kernel is
diffusers' own ``RMSNorm.forward`` on each worker's shard, so the values are diffusers' values.
The rule follows the maths: every dim but the last (the one normalised) may be split; the
weight and bias are replicated. With gradients, autocast or plain tensors diffusers' forward
runs.
"""

from __future__ import annotations

import torch

from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

from .modulate import one_op_applies

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("rms_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor")


class _Norm:
    """What ``RMSNorm.forward`` reads of its module."""

    def __init__(self, weight, bias, eps):
        self.weight, self.bias, self.eps = weight, bias, eps


def rms_norm_kernel(x, weight, bias, eps):
    """diffusers' ``RMSNorm.forward`` of ``x`` with this ``weight``, ``bias`` and ``eps``."""
    from diffusers.models.normalization import RMSNorm

    return RMSNorm.forward(_Norm(weight, bias, eps), x)


LIBRARY.impl("rms_norm", rms_norm_kernel, "CompositeExplicitAutograd")
rms_norm_op = torch.ops.dtorch_hf.rms_norm.default


def rms_norm_strategies(call):
    """x (..., features), weight and bias (features) where given -> like x; any dim of x but
    the last may be split."""
    others = (R,) * (len(call.inputs) - 1)
    return [Strategy((R, *others), (R,))] + [Strategy((Shard(d), *others), (Shard(d),))
                                              for d in range(call.inputs[0].ndim - 1)]


def one_op_forward(module):
    """``module.forward`` (a diffusers ``RMSNorm``): the one op where :func:`one_op_applies`."""
    original = module.forward

    def forward(hidden_states):
        if not one_op_applies(hidden_states):
            return original(hidden_states)
        return rms_norm_op(hidden_states, module.weight, module.bias, float(module.eps))

    return forward


def one_op_rms_norms(model) -> None:
    """Give every diffusers ``RMSNorm`` of ``model`` the one-op forward."""
    from diffusers.models.normalization import RMSNorm

    for module in model.modules():
        if type(module) is RMSNorm:
            module.forward = one_op_forward(module)


def register(registry) -> None:
    registry.add(rms_norm_op, Rule(rms_norm_strategies, kernel="dtorch_hf::rms_norm"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::rms_norm", rms_norm_kernel)
