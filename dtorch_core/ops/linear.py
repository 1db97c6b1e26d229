"""``F.linear`` as one op: ``dtorch::linear`` and its backward ``dtorch::linear_backward``.

Called on a 3-D input, ``F.linear`` reaches a distributed tensor as four ops (``t``, ``view``,
``addmm``, ``view``) and its backward as about eight, each a dispatch on the controller, where
torch pays one C++ call. The Linears of a model that dtorch distributes run these two ops
instead (``dtorch_core.nn.linear``): one plan each, with the einsum rule of a contraction over
the input's leading dims, so a sequence shard of a (batch, seq, features) input stays a shard
whatever the batch (no (batch x seq) view to merge). On plain and meta tensors the ops are
torch's own calls (the controller infers the outputs this way); the workers run
``torch._C._nn.linear`` itself, and the backward computes what autograd computes for it
(``grad @ weight``, ``grad^T @ input``, the sum of ``grad``) with the same calls.
"""

from __future__ import annotations

import math

import torch

from ..placement import Shard
from ..planner.schema import Rule, Strategy
from .common import LINEAR_PARTIALS, R
from .matmul import contraction

LIBRARY = torch.library.Library("dtorch", "DEF")
LIBRARY.define("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor")
LIBRARY.define("linear_backward(Tensor grad_output, Tensor input, Tensor weight, bool[3] output_mask)"
               " -> (Tensor, Tensor, Tensor)")


def linear_kernel(input, weight, bias=None):
    return torch._C._nn.linear(input, weight, bias)


def rows(t):
    """``t`` as a matrix of its last dim (a view where it can be), also with no elements."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def linear_backward_kernel(grad_output, input, weight, output_mask):
    """(grad input, grad weight, grad bias); an output not asked for in ``output_mask`` is an
    empty tensor (nothing computed)."""
    none = grad_output.new_empty(0)
    grad = rows(grad_output)
    grad_input = grad.mm(weight).view(input.shape) if output_mask[0] else none
    # (grad^T @ input), as torch's addmm backward computes it for a transposed weight (the same
    # call, and the parameter's own layout: nothing to copy when it accumulates)
    grad_weight = grad.t().mm(rows(input)) if output_mask[1] else none
    grad_bias = grad.sum(0) if output_mask[2] else none
    return grad_input, grad_weight, grad_bias


LIBRARY.impl("linear", linear_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("linear_backward", linear_backward_kernel, "CompositeExplicitAutograd")
linear = torch.ops.dtorch.linear.default
linear_backward = torch.ops.dtorch.linear_backward.default
LEADING = "abcdefghij"  # labels of the input's leading dims ("k": features in, "n": out)


def linear_strategies(call):
    x = call.inputs[0]
    lead = LEADING[:x.ndim - 1]
    if len(call.inputs) == 2:
        return contraction((lead + "k", "nk"), lead + "n")(call)
    # contraction() takes the added input (the bias) first; the op takes it last
    bias_first = type(call)(call.op, call.args, call.kwargs, (call.inputs[2],) + call.inputs[:2], call.outputs,
                            call.specs)
    strategies = contraction((lead + "k", "nk"), lead + "n", additive=1)(bias_first)
    return [Strategy(s.inputs[1:] + s.inputs[:1], s.outputs) for s in strategies]


def linear_backward_strategies(call):
    """grad_output (lead, n), input (lead, k), weight (n, k) -> grad input (lead, k), grad weight
    (n, k), grad bias (n); an output not asked for (empty) is replicated."""
    grad, x = call.inputs[0], call.inputs[1]
    last = x.ndim - 1
    mask = call.args[3]

    def outs(*placements):
        return tuple(p if wanted else R for p, wanted in zip(placements, mask))

    result = [Strategy((R, R, R), outs(R, R, R))]
    for d in range(last):  # a leading dim split: each rank's rows give a partial sum of weight and bias
        for p in LINEAR_PARTIALS[:1]:
            result.append(Strategy((Shard(d), Shard(d), R), outs(Shard(d), p, p)))
    for p in LINEAR_PARTIALS[:1]:  # out features split (colwise)
        result.append(Strategy((Shard(grad.ndim - 1), R, Shard(0)), outs(p, Shard(0), Shard(0))))
    result.append(Strategy((R, Shard(last), Shard(1)), outs(Shard(last), Shard(1), R)))  # in features (rowwise)
    for p in LINEAR_PARTIALS:  # linear in each input
        result.append(Strategy((p, R, R), outs(p, p, p)))
        result.append(Strategy((R, p, R), outs(R, p, R)))
        result.append(Strategy((R, R, p), outs(p, R, R)))
    return result


def register(registry) -> None:
    registry.add(linear, Rule(linear_strategies, kernel="dtorch::linear"))
    registry.add(linear_backward, Rule(linear_backward_strategies, kernel="dtorch::linear_backward"))


def register_kernels(registry) -> None:
    registry.add("dtorch::linear", torch._C._nn.linear)
    registry.add("dtorch::linear_backward", linear_backward_kernel)
