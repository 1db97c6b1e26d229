"""Neural-network ops: softmax, layer norm, embedding, attention, losses, dropout."""

from __future__ import annotations

import torch

from ..placement import Partial, Shard
from .common import LINEAR_PARTIALS, R, add_all, pointwise_strategies, replicate_all
from .registry import Rule, Strategy

aten = torch.ops.aten
PSUM = Partial("sum")


def _dim(call, index):
    nd = call.inputs[0].ndim
    return call.args[index] % nd if nd else 0


def softmax_rule(call):
    return pointwise_strategies(call, skip_dims=(_dim(call, 1),))


def softmax_backward_rule(call):
    return pointwise_strategies(call, skip_dims=(_dim(call, 2),))


def layer_norm_rule(call):
    x = call.inputs[0]
    k = len(call.args[1])
    n_in, n_out = len(call.inputs), len(call.outputs)
    out = [replicate_all(call)]
    for d in range(x.ndim - k):
        out.append(Strategy((Shard(d),) + (R,) * (n_in - 1), (Shard(d),) * n_out))
    return out


def layer_norm_backward_rule(call):
    # inputs: grad_out, input, mean, rstd, [weight], [bias]; outputs: grad_input, grad_weight, grad_bias
    x = call.inputs[1]
    k = len(call.args[2])
    n_in = len(call.inputs)
    out = [replicate_all(call)]
    for d in range(x.ndim - k):
        ins = (Shard(d),) * 4 + (R,) * (n_in - 4)
        outs = (Shard(d), PSUM, PSUM)
        out.append(Strategy(ins, outs))
    for p in LINEAR_PARTIALS:
        out.append(Strategy((p,) + (R,) * (n_in - 1), (p, p, p)))
    return out


def embedding_rule(call):
    weight, idx = call.inputs[0], call.inputs[1]
    out = [replicate_all(call)]
    for d in range(idx.ndim):
        out.append(Strategy((R, Shard(d)), (Shard(d),)))
    out.append(Strategy((Shard(1), R), (Shard(idx.ndim),)))
    out.append(Strategy((Shard(0), R), (PSUM,)))  # vocab-sharded table: masked local lookup
    for p in LINEAR_PARTIALS:
        out.append(Strategy((p, R), (p,)))
    return out


def embedding_localize(local):
    off, length = local.in_regions[0][0]
    total = local.in_specs[0].shape[0]
    return local.args, dict(local.kwargs, vocab_offset=off, vocab_size=length, vocab_total=total)


def embedding_backward_rule(call):
    grad, idx = call.inputs[0], call.inputs[1]
    out = [replicate_all(call)]
    for d in range(idx.ndim):
        out.append(Strategy((Shard(d), Shard(d)), (PSUM,)))
    out.append(Strategy((Shard(grad.ndim - 1), R), (Shard(1),)))
    out.append(Strategy((R, R), (Shard(0),)))  # rows of a vocab-sharded table
    for p in LINEAR_PARTIALS:
        out.append(Strategy((p, R), (p,)))
    return out


def embedding_backward_localize(local):
    off, length = local.out_regions[0][0]
    return local.args, dict(local.kwargs, vocab_offset=off, vocab_size=length)


def batch_dims_rule(dims=(0, 1)):
    """Attention-like ops: shards on the batch/head dims pass through every input and output
    whose size matches the query's (broadcast inputs such as masks stay Replicate)."""

    def strategies(call):
        q = call.inputs[0]
        out = [replicate_all(call)]
        for d in dims:
            if d >= q.ndim:
                continue
            ins = tuple(Shard(d) if t.ndim > d and t.shape[d] == q.shape[d] else R for t in call.inputs)
            outs = tuple(
                R if o is None else (Shard(d) if o.ndim > d and o.shape[d] == q.shape[d] else R)
                for o in call.outputs
            )
            if any(o is not None and p == R and o.numel() > 0 for o, p in zip(call.outputs, outs)):
                continue
            out.append(Strategy(ins, outs))
        return out

    return strategies


def nll_loss_rule(call):
    # inputs: self [N, C] or [C], target, [weight], [total_weight for backward]
    x = call.inputs[0]
    n_in, n_out = len(call.inputs), len(call.outputs)
    reduction = call.args[3] if len(call.args) > 3 else call.kwargs.get("reduction", 1)
    out = [replicate_all(call)]
    if x.ndim == 2:
        rest = (R,) * (n_in - 2)
        if reduction == 0:
            out.append(Strategy((Shard(0), Shard(0)) + rest, (Shard(0), R)))
        elif reduction == 2:
            out.append(Strategy((Shard(0), Shard(0)) + rest, (PSUM, PSUM)))
    return out


def nll_loss_forward_decomposition(x, target, weight, reduction, ignore_index):
    """Mean loss over a batch-sharded input: sum locally, then divide by the global weight."""
    from ..dispatch import dispatch_direct
    from ..tensor import DTensor

    sharded = isinstance(x, DTensor) and x.ndim == 2 and any(
        isinstance(p, Shard) and p.dim == 0 for p in x._spec.placements
    )
    if reduction != 1 or not sharded:
        return dispatch_direct(aten.nll_loss_forward.default, (x, target, weight, reduction, ignore_index), {})
    total, weight_sum = aten.nll_loss_forward.default(x, target, weight, 2, ignore_index)
    return aten.div.Tensor(total, weight_sum), weight_sum


def nll_loss_backward_rule(call):
    # inputs: grad_output, self, target, [weight], total_weight
    x = call.inputs[1]
    n_in = len(call.inputs)
    reduction = call.args[4]
    out = [replicate_all(call)]
    if x.ndim == 2:
        g = Shard(0) if reduction == 0 else R
        out.append(Strategy((g, Shard(0), Shard(0)) + (R,) * (n_in - 3), (Shard(0),)))
    return out


def dropout_localize(local):
    spec = local.out_specs[0]
    return local.args, dict(local.kwargs, region=local.out_regions[0], global_shape=spec.shape)


def register(registry) -> None:
    for op in (aten._softmax.default, aten._log_softmax.default):
        registry.add(op, softmax_rule, replace=True)
    for op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        registry.add(op, softmax_backward_rule, replace=True)
    registry.add(aten.native_layer_norm.default, layer_norm_rule)
    registry.add(aten.native_layer_norm_backward.default, layer_norm_backward_rule)
    registry.add(aten.embedding.default, Rule(embedding_rule, embedding_localize, "dtorch::embedding"))
    registry.add(
        aten.embedding_dense_backward.default,
        Rule(embedding_backward_rule, embedding_backward_localize, "dtorch::embedding_backward"),
    )
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):
        packet = getattr(aten, name, None)
        if packet is not None:
            add_all(registry, packet, batch_dims_rule())
    registry.add(aten.nll_loss_forward.default, nll_loss_rule)
    registry.add_decomposition(aten.nll_loss_forward.default, nll_loss_forward_decomposition)
    registry.add(aten.nll_loss_backward.default, nll_loss_backward_rule)
    registry.add(
        aten.native_dropout.default,
        Rule(lambda call: pointwise_strategies(call), dropout_localize, "dtorch::native_dropout"),
        replace=True,
    )
