"""Elementwise losses (mse, l1, smooth-l1/huber, binary cross entropy) and their backward ops.

When an input is sharded (or a partial sum) they are decomposed on the controller into pointwise
ops and a sum, then divided by the global element count: a mean over uneven shards stays exact
(averaging per-shard means would not be). When every input is whole on each worker, the workers
run torch's own loss op.
"""

from __future__ import annotations

import torch

from ..tensor import DTensor
from .common import planned_directly_when, replicate_all

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2


def _reduce(loss, reduction):
    if reduction == NONE:
        return loss
    total = aten.sum.default(loss)
    if reduction == SUM:
        return total
    return aten.div.Scalar(total, max(loss.numel(), 1))


def _scale_grad(grad, grad_output, reduction, numel):
    g = aten.mul.Tensor(grad, grad_output)
    return aten.div.Scalar(g, numel) if reduction == MEAN else g


def mse_loss(input, target, reduction=MEAN):
    d = aten.sub.Tensor(input, target)
    return _reduce(aten.mul.Tensor(d, d), reduction)


def mse_loss_backward(grad_output, input, target, reduction):
    d = aten.mul.Scalar(aten.sub.Tensor(input, target), 2.0)
    return _scale_grad(d, grad_output, reduction, input.numel())


def l1_loss(input, target, reduction=MEAN):
    return _reduce(aten.abs.default(aten.sub.Tensor(input, target)), reduction)


def smooth_l1_loss(input, target, reduction=MEAN, beta=1.0):
    if beta == 0:
        return l1_loss(input, target, reduction)
    d = aten.sub.Tensor(input, target)
    a = aten.abs.default(d)
    quad = aten.mul.Scalar(aten.mul.Tensor(d, d), 0.5 / beta)
    lin = aten.sub.Scalar(a, 0.5 * beta)
    return _reduce(aten.where.self(aten.lt.Scalar(a, beta), quad, lin), reduction)


def huber_loss(input, target, reduction=MEAN, delta=1.0):
    d = aten.sub.Tensor(input, target)
    a = aten.abs.default(d)
    quad = aten.mul.Scalar(aten.mul.Tensor(d, d), 0.5)
    lin = aten.mul.Scalar(aten.sub.Scalar(a, 0.5 * delta), delta)
    return _reduce(aten.where.self(aten.lt.Scalar(a, delta), quad, lin), reduction)


def smooth_l1_loss_backward(grad_output, input, target, reduction, beta):
    d = aten.sub.Tensor(input, target)
    if beta == 0:
        g = aten.sign.default(d)
    else:
        g = aten.clamp.default(aten.div.Scalar(d, beta), -1.0, 1.0)
    return _scale_grad(g, grad_output, reduction, input.numel())


def huber_loss_backward(grad_output, input, target, reduction, delta):
    d = aten.sub.Tensor(input, target)
    g = aten.clamp.default(d, -delta, delta)
    return _scale_grad(g, grad_output, reduction, input.numel())


def binary_cross_entropy(input, target, weight=None, reduction=MEAN):
    # torch clamps the logs at -100
    log_p = aten.clamp_min.default(aten.log.default(input), -100.0)
    log_q = aten.clamp_min.default(aten.log.default(aten.rsub.Scalar(input, 1.0)), -100.0)
    loss = aten.neg.default(
        aten.add.Tensor(aten.mul.Tensor(target, log_p), aten.mul.Tensor(aten.rsub.Scalar(target, 1.0), log_q))
    )
    if weight is not None:
        loss = aten.mul.Tensor(loss, weight)
    return _reduce(loss, reduction)


def binary_cross_entropy_backward(grad_output, input, target, weight=None, reduction=MEAN):
    eps = 1e-12
    denom = aten.clamp_min.default(aten.mul.Tensor(input, aten.rsub.Scalar(input, 1.0)), eps)
    g = aten.div.Tensor(aten.sub.Tensor(input, target), denom)
    if weight is not None:
        g = aten.mul.Tensor(g, weight)
    return _scale_grad(g, grad_output, reduction, input.numel())


def _replicated(x) -> bool:
    return not isinstance(x, DTensor) or x._spec.is_replicated()


def replicated_rule(call):
    return [replicate_all(call)]


def local_unless_sharded(decomposition):
    """Run the op itself on the workers when every input is whole on each of them (torch's one
    kernel); decompose only when a shard or a partial sum must be reduced across workers."""

    def direct(*args, **kwargs):
        return all(_replicated(a) for a in args) and all(_replicated(v) for v in kwargs.values())

    def run(*args, **kwargs):  # its own function object: the predicate is set on it
        return decomposition(*args, **kwargs)

    return planned_directly_when(run, direct)


def register(registry) -> None:
    for op, fn in (
        (aten.mse_loss.default, mse_loss),
        (aten.mse_loss_backward.default, mse_loss_backward),
        (aten.smooth_l1_loss.default, smooth_l1_loss),
        (aten.smooth_l1_loss_backward.default, smooth_l1_loss_backward),
        (aten.huber_loss.default, huber_loss),
        (aten.huber_loss_backward.default, huber_loss_backward),
        (aten.binary_cross_entropy.default, binary_cross_entropy),
        (aten.binary_cross_entropy_backward.default, binary_cross_entropy_backward),
    ):
        registry.add(op, replicated_rule, replace=True)
        registry.add_decomposition(op, local_unless_sharded(fn))
