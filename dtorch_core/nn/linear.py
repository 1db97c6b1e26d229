"""The Linears of a distributed model as one op each (``dtorch::linear``, ops/linear.py).

Every dtorch entry point that distributes a module's parameters (``parallelize_module``,
``data_parallel``, ``fully_shard``, ``materialize``; dtorch_hf's ``parallelize``) makes each
``nn.Linear`` in it call :func:`linear`: one plan forward and one backward where ``F.linear`` on
a 3-D input costs four and about eight dispatches, with the same values. Plain tensors, a
``nn.Linear`` subclass with its own ``forward``, autocast and double backward keep torch's
``F.linear``; ``DTORCH_ONE_OP_LINEAR=0`` keeps it everywhere.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear import linear as linear_op
from ..ops.linear import linear_backward, rows
from ..tensor import DTensor


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return linear_op(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        n = len(ctx.needs_input_grad)  # 2 where F.linear was called without a bias
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], n == 3 and ctx.needs_input_grad[2] and ctx.has_bias]
        if torch.is_grad_enabled():  # create_graph: differentiable ops, so a second backward works
            grad = rows(grad_output)
            grads = (grad.mm(weight).view(input.shape) if mask[0] else None,
                     grad.t().mm(rows(input)) if mask[1] else None, grad.sum(0) if mask[2] else None)
        else:
            grads = tuple(g if m else None for g, m in zip(linear_backward(grad_output, input, weight, mask), mask))
        return grads[:n]


# torch.autograd.Function.apply less its Python wrapper (which only unwraps functorch's dead
# wrappers and binds defaults for setup_context, neither of which applies here): about 2 us a call
_apply = super(torch.autograd.Function, _Linear).apply


def linear(input, weight, bias=None):
    """``F.linear(input, weight, bias)``; on distributed tensors as one op (module docstring)."""
    if not (type(input) is DTensor and type(weight) is DTensor and (bias is None or type(bias) is DTensor)) \
            or torch.is_autocast_enabled(input.device.type):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        if torch._C._are_functorch_transforms_active():
            return _Linear.apply(input, weight, bias)
        return _apply(input, weight, bias)
    return linear_op(input, weight, bias)


def _forward(self, input):
    return linear(input, self.weight, self.bias)


def one_op_linears(module: nn.Module) -> None:
    """Make every ``nn.Linear`` of ``module`` (not a subclass with a forward of its own, which
    may not be ``F.linear``) run :func:`linear`."""
    if os.environ.get("DTORCH_ONE_OP_LINEAR", "1") == "0":
        return
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and type(sub).forward is nn.Linear.forward and "forward" not in sub.__dict__:
            sub.forward = types.MethodType(_forward, sub)
