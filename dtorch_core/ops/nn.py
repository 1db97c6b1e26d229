"""Neural-network ops: softmax, layer norm, embedding, attention, losses, dropout."""

from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .common import LINEAR_PARTIALS, R, planned_directly_when, pointwise_strategies, replicate_all
from .kernels import attention_kernel_name, attention_overloads
from ..planner.schema import Rule, Strategy
from ..tensor import DTensor
from ..planner.factories import factory

aten = torch.ops.aten
PSUM = Partial("sum")


def _dim(call, index):
    nd = call.inputs[0].ndim
    return call.args[index] % nd if nd else 0


def softmax_rule(call):
    return pointwise_strategies(call, skip_dims=(_dim(call, 1),))


def _sharded_along(x, dim) -> bool:
    return isinstance(x, DTensor) and any(
        isinstance(p, Shard) and p.dim == dim % x.ndim for p in x._spec.placements
    )


def softmax_decomposition(op):
    """Softmax over a sharded dim without gathering it: the max and the sum of exponentials
    reduce exactly across shards (small all-reduces), and the result keeps the shards."""
    log = op is aten._log_softmax.default

    def direct(x, dim, half_to_float):
        return not _sharded_along(x, dim) or half_to_float

    def run(x, dim, half_to_float):  # the softmax dim is sharded
        shifted = aten.sub.Tensor(x, aten.amax.default(x, [dim], True))
        exps = aten.exp.default(shifted)
        total = aten.sum.dim_IntList(exps, [dim], True)
        if log:
            return aten.sub.Tensor(shifted, aten.log.default(total))
        return aten.div.Tensor(exps, total)

    return planned_directly_when(run, direct)


def softmax_backward_decomposition(op):
    """The backward ops through the same reductions, when the softmax dim is sharded."""
    log = op is aten._log_softmax_backward_data.default

    def direct(grad, out, dim, input_dtype):
        return not (_sharded_along(grad, dim) or _sharded_along(out, dim)) or grad.dtype != input_dtype

    def run(grad, out, dim, input_dtype):  # the softmax dim is sharded
        if log:  # grad - exp(out) * sum(grad)
            total = aten.sum.dim_IntList(grad, [dim], True)
            return aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), total))
        total = aten.sum.dim_IntList(aten.mul.Tensor(grad, out), [dim], True)  # out * (grad - sum(grad*out))
        return aten.mul.Tensor(out, aten.sub.Tensor(grad, total))

    return planned_directly_when(run, direct)


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


def norm_backward_rule(row_inputs: int):
    """The backward of a norm over the trailing dims (layer norm, fused RMS norm): a shard of a
    leading dim passes through the first ``row_inputs`` tensor inputs (the gradient, the input
    and the saved per-row statistics) and the input gradient; the affine gradients are partial
    sums. Everything is linear in the incoming gradient, so its Partial passes through."""

    def rule(call):
        # layer norm: grad_out, input, mean, rstd, [weight], [bias] -> grad_input, grad_weight, grad_bias
        # fused rms norm: grad_out, input, rstd, [weight] -> grad_input, grad_weight
        x = call.inputs[1]
        k = len(call.args[2])
        n_in, n_out = len(call.inputs), len(call.outputs)
        out = [replicate_all(call)]
        for d in range(x.ndim - k):
            ins = (Shard(d),) * row_inputs + (R,) * (n_in - row_inputs)
            out.append(Strategy(ins, ((Shard(d),) + (PSUM,) * (n_out - 1))))
        for p in LINEAR_PARTIALS:
            out.append(Strategy((p,) + (R,) * (n_in - 1), (p,) * n_out))
        return out

    return rule


def embedding_rule(call):
    idx = call.inputs[1]
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
    scale_grad_by_freq = bool(call.args[4]) if len(call.args) > 4 else bool(call.kwargs.get("scale_grad_by_freq"))
    out = [replicate_all(call)]
    if not scale_grad_by_freq:  # index frequencies must be counted over every index
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


MASK_ARGS = ("attn_mask", "attn_bias")


def tensor_arg_names(op, args, kwargs) -> list:
    """The schema argument name of each tensor input, in flattening order."""
    names = []
    for i, arg in enumerate(op._schema.arguments):
        v = kwargs.get(arg.name) if arg.name in kwargs else (args[i] if i < len(args) else None)
        if isinstance(v, torch.Tensor):
            names.append(arg.name)
        elif isinstance(v, (list, tuple)):
            names.extend(arg.name for a in v if isinstance(a, torch.Tensor))
    return names


def attention_rule(call):
    """Attention ops (query ``[B, H, L, E]``): a shard of the batch or head dim passes through
    every input and output that has that dim. Masks and biases broadcast right-aligned against
    ``[B, H, L, S]`` (a ``[L, S]`` mask has no batch dim even when ``L == B``): they are
    sharded where they have the dim and Replicate where they broadcast over it. A bias gradient
    over a broadcast dim is a Partial sum."""
    names = tensor_arg_names(call.op, call.args, call.kwargs)
    if "query" not in names:
        return [replicate_all(call)]
    q = call.inputs[names.index("query")]
    mask = next((call.inputs[i] for i, n in enumerate(names) if n in MASK_ARGS), None)
    grad_bias_index = 3 if call.op.name().endswith("efficient_attention_backward") else None
    out = [replicate_all(call)]
    for d in (0, 1):
        if d >= q.ndim:
            continue
        mask_placement = None
        if mask is not None:
            md = d - (q.ndim - mask.ndim)
            if md >= 0 and mask.shape[md] == q.shape[d]:
                mask_placement = Shard(md)
            elif md < 0 or mask.shape[md] == 1:
                mask_placement = R
            else:
                continue
        ins = []
        for name, t in zip(names, call.inputs):
            if name in MASK_ARGS:
                ins.append(mask_placement)
            elif t.ndim > d and t.shape[d] == q.shape[d]:
                ins.append(Shard(d))
            elif t.ndim <= 1:
                ins.append(R)  # RNG state scalars
            else:
                break
        if len(ins) != len(names):
            continue
        outs = []
        for k, o in enumerate(call.outputs):
            if o is None:
                outs.append(R)
            elif k == grad_bias_index:
                outs.append(PSUM if mask_placement == R else mask_placement)
            elif o.ndim > d and o.shape[d] == q.shape[d]:
                outs.append(Shard(d))
            elif o.ndim <= 1 or o.numel() == 0:
                outs.append(R)
            else:
                break
        if len(outs) == len(call.outputs):
            out.append(Strategy(tuple(ins), tuple(outs)))
    return out


def _nll_batch_dims(x) -> dict:
    """Input dim -> target dim for the batch dims of an nll loss input ``[N, C, d1, ...]``."""
    if x.ndim < 2:
        return {}
    return {d: (0 if d == 0 else d - 1) for d in range(x.ndim) if d != 1}


def nll_loss_rule(call):
    # nll_loss_forward / nll_loss2d_forward(self [N, C, ...] or [C], target [N, ...], weight,
    # reduction, ignore_index) -> (output, total_weight)
    x = call.inputs[0]
    n_in = len(call.inputs)
    reduction = call.args[3] if len(call.args) > 3 else call.kwargs.get("reduction", 1)
    out = [replicate_all(call)]
    rest = (R,) * (n_in - 2)
    for d, td in _nll_batch_dims(x).items():
        if reduction == 0:
            out.append(Strategy((Shard(d), Shard(td)) + rest, (Shard(td), R)))
        elif reduction == 2:
            out.append(Strategy((Shard(d), Shard(td)) + rest, (PSUM, PSUM)))
    return out


def nll_loss_forward_decomposition(op):
    """Mean loss over a batch-sharded input: sum locally, then divide by the global weight
    (exact for uneven shards, unlike a mean of per-shard means)."""

    def direct(x, target, weight, reduction, ignore_index):
        if op is aten.nll_loss_forward.default and _class_sharded(x):
            return False
        batch_dims = _nll_batch_dims(x)
        sharded = isinstance(x, DTensor) and any(
            isinstance(p, Shard) and p.dim in batch_dims for p in x._spec.placements
        )
        return reduction != 1 or not sharded

    def decomposition(x, target, weight, reduction, ignore_index):
        if op is aten.nll_loss_forward.default and _class_sharded(x):
            return _class_sharded_nll(x, target, weight, reduction, ignore_index)
        total, weight_sum = op(x, target, weight, 2, ignore_index)
        return aten.div.Tensor(total, weight_sum), weight_sum

    return planned_directly_when(decomposition, direct)


def _class_sharded(x) -> bool:
    """A 2-D nll input whose class dim is sharded (vocab-parallel logits)."""
    return x.ndim == 2 and _sharded_along(x, 1)


def _class_one_hot(x, target, ignore_index):
    """[N, C] weights-to-be: 1 where the class is the target (and the target is not ignored),
    laid out like ``x`` along the class dim, so nothing of ``x`` is gathered."""
    classes = x.shape[1]
    placements = tuple(
        Shard(0) if isinstance(p, Shard) and p.dim == 1 else Replicate() for p in x._spec.placements
    )
    iota = factory(x._handle.session, "arange", (classes,), x._spec.mesh, list(placements), None, fill=(0, 1))
    hit = aten.eq.Tensor(aten.unsqueeze.default(iota, 0), aten.unsqueeze.default(target, 1))
    keep = aten.ne.Scalar(target, ignore_index)
    return aten.mul.Tensor(aten._to_copy.default(hit, dtype=x.dtype),
                           aten.unsqueeze.default(aten._to_copy.default(keep, dtype=x.dtype), 1))


def _class_sharded_nll(x, target, weight, reduction, ignore_index):
    """nll over class-sharded log-probs: the picked value is a sum over the class shards."""
    one_hot = _class_one_hot(x, target, ignore_index)
    if weight is not None:
        one_hot = aten.mul.Tensor(one_hot, aten.unsqueeze.default(weight, 0))
    row_weight = aten.sum.dim_IntList(one_hot, [1], False)
    losses = aten.neg.default(aten.sum.dim_IntList(aten.mul.Tensor(x, one_hot), [1], False))
    total_weight = aten.sum.default(row_weight)
    if reduction == 0:
        return losses, total_weight
    total = aten.sum.default(losses)
    if reduction == 2:
        return total, total_weight
    return aten.div.Tensor(total, total_weight), total_weight


def nll_loss_backward_decomposition(grad_output, x, target, weight, reduction, ignore_index, total_weight):
    """The gradient for class-sharded log-probs: -weight(target) at the target, scaled."""
    one_hot = _class_one_hot(x, target, ignore_index)
    if weight is not None:
        one_hot = aten.mul.Tensor(one_hot, aten.unsqueeze.default(weight, 0))
    grad = aten.neg.default(one_hot)
    if reduction == 0:
        return aten.mul.Tensor(grad, aten.unsqueeze.default(grad_output, 1))
    grad = aten.mul.Tensor(grad, grad_output)
    return aten.div.Tensor(grad, total_weight) if reduction == 1 else grad


planned_directly_when(nll_loss_backward_decomposition, lambda grad_output, x, *rest: not _class_sharded(x))


def nll_loss_backward_rule(call):
    # nll_loss(2d)_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)
    x = call.inputs[1]
    n_in = len(call.inputs)
    reduction = call.args[4]
    out = [replicate_all(call)]
    for d, td in _nll_batch_dims(x).items():
        g = Shard(td) if reduction == 0 else R
        out.append(Strategy((g, Shard(d), Shard(td)) + (R,) * (n_in - 3), (Shard(d),)))
    return out


def random_localize(op_name):
    """Random ops draw the global tensor from the seed and keep their region (see kernels)."""

    def localize(local):
        kwargs = {k: v for k, v in local.kwargs.items() if k != "generator"}
        spec = local.out_specs[0]
        return local.args, dict(kwargs, op=op_name, region=local.out_regions[0], global_shape=spec.shape)

    return localize


def random_rule(call):
    # no Partial: a random tensor is not a sum of per-rank parts
    return pointwise_strategies(call)


def dropout_localize(local):
    spec = local.out_specs[0]
    return local.args, dict(local.kwargs, region=local.out_regions[0], global_shape=spec.shape)


def register(registry) -> None:
    for op in (aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default):
        registry.add(op, softmax_rule, replace=True)
    for op in (aten._softmax.default, aten._log_softmax.default):
        registry.add_decomposition(op, softmax_decomposition(op))
    for op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        registry.add_decomposition(op, softmax_backward_decomposition(op))
    for op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        registry.add(op, softmax_backward_rule, replace=True)
    registry.add(aten.native_layer_norm.default, layer_norm_rule)
    registry.add(aten.native_layer_norm_backward.default, norm_backward_rule(4))
    # F.rms_norm on CUDA tensors (the handles of a cuda mesh) calls the fused op: the workers run
    # it (one kernel each way, as torch does), not its decomposition into elementwise ops
    if hasattr(aten, "_fused_rms_norm"):
        registry.add(aten._fused_rms_norm.default, layer_norm_rule, replace=True)
        registry.add(aten._fused_rms_norm_backward.default, norm_backward_rule(3), replace=True)
    registry.add(aten.embedding.default, Rule(embedding_rule, embedding_localize, "dtorch::embedding"))
    registry.add(
        aten.embedding_dense_backward.default,
        Rule(embedding_backward_rule, embedding_backward_localize, "dtorch::embedding_backward"),
    )
    for op in attention_overloads():
        registry.add(op, Rule(attention_rule, kernel=attention_kernel_name(op)), replace=True)
    for forward, backward in ((aten.nll_loss_forward.default, aten.nll_loss_backward.default),
                              (aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default)):
        registry.add(forward, nll_loss_rule, replace=True)
        registry.add_decomposition(forward, nll_loss_forward_decomposition(forward), replace=True)
        registry.add(backward, nll_loss_backward_rule, replace=True)
    registry.add_decomposition(aten.nll_loss_backward.default, nll_loss_backward_decomposition, replace=True)
    for op in (aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.bernoulli.p, aten.bernoulli.default):
        name = op._schema.name.split("::")[1]
        registry.add(op, Rule(random_rule, random_localize(name), "dtorch::bernoulli"), replace=True)
    fills = [aten.rand_like.default, aten.randn_like.default]
    for packet in (aten.uniform_, aten.normal_, aten.exponential_, aten.cauchy_, aten.log_normal_,
                   aten.geometric_, aten.random_):
        fills += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    for op in fills:
        if len([a for a in op._schema.arguments if a.type.kind() == "TensorType"]) != 1:
            continue  # e.g. normal_ with tensor mean/std: not a plain fill
        name = op._schema.name.split("::")[1]
        registry.add(op, Rule(random_rule, random_localize(name), "dtorch::random_fill"), replace=True)
    registry.add(
        aten.native_dropout.default,
        Rule(lambda call: pointwise_strategies(call), dropout_localize, "dtorch::native_dropout"),
        replace=True,
    )
