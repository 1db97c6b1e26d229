"""Convolution-network ops: convolution, group norm and nearest upsampling, with their backward.

What a VAE or a UNet is made of. The batch dim is never mixed by these ops, so a batch shard
(uneven and empty shards included) passes through every one of them as a local call; the static
arguments that carry the batch size (group norm's ``N``, the upsampling backward's
``input_size``) are rewritten per rank. Spatial shards are not served: a convolution needs its
neighbours' rows (halos), so a spatially sharded input is gathered by the strategy choice.
"""

from __future__ import annotations

import torch

from ..placement import Partial, Shard
from ..planner.schema import Rule, Strategy
from .common import ALL_PARTIALS, LINEAR_PARTIALS, R, dim_map_strategies, replicate_all

aten = torch.ops.aten
PSUM = Partial("sum")
S0, S1 = Shard(0), Shard(1)


def _conv_args(args):
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return bool(args[6]), int(args[8])


def convolution_rule(call):
    """A batch shard of the input with the weight (and bias) replicated gives a batch-sharded
    output. Output channels: a weight sharded on them (dim 0; dim 1 when transposed) with the
    bias alike gives Shard(1) of the output (groups of 1 only: grouped channels must stay in
    their group). Without a bias the op is linear in the input and in the weight, so a Partial
    of either passes through, and an input-channel shard of both is a Partial sum."""
    transposed, groups = _conv_args(call.args)
    has_bias = len(call.inputs) == 3
    rest = (R,) * (len(call.inputs) - 1)
    out = [replicate_all(call), Strategy((S0,) + rest, (S0,))]
    if groups == 1:
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        bias = (S0,) if has_bias else ()
        out.append(Strategy((R, Shard(out_dim)) + bias, (S1,)))
        if not has_bias:
            out.append(Strategy((S1, Shard(in_dim)), (PSUM,)))
    if not has_bias:
        for p in LINEAR_PARTIALS:
            out += [Strategy((p, R), (p,)), Strategy((R, p), (p,))]
    return out


def convolution_backward_rule(call):
    """grad_output, input, weight -> grad_input, grad_weight, grad_bias. A batch shard of the
    gradient and the input gives a batch-sharded grad_input and Partial-sum weight and bias
    gradients; an output-channel shard of the gradient and the weight gives channel-sharded
    weight and bias gradients and a Partial-sum grad_input (groups of 1 only). Everything is
    linear in grad_output, so its Partial passes through."""
    transposed, groups = int(call.args[7]) != 0, int(call.args[9])
    out = [replicate_all(call), Strategy((S0, S0, R), (S0, PSUM, PSUM))]
    if groups == 1:
        out_dim = 1 if transposed else 0
        out.append(Strategy((S1, R, Shard(out_dim)), (PSUM, Shard(out_dim), S0)))
    for p in LINEAR_PARTIALS:
        out.append(Strategy((p, R, R), (p, p, p)))
    return out


def convolution_backward_localize(local):
    # bias_sizes (args[3]) is the bias's shape: a channel-sharded grad_bias has its local length
    args = list(local.args)
    grad_bias_region = local.out_regions[2]
    if args[3] is not None and grad_bias_region is not None:
        args[3] = [grad_bias_region[0][1]]
    return tuple(args), local.kwargs


GROUP_NORM_KERNEL = "dtorch::native_group_norm"


def native_group_norm_kernel(x, *args):
    """The workers' native_group_norm: its CPU kernel requires an input dense in its suggested
    memory format, which torch's group_norm prepares from the strides it sees. The controller
    sees the global tensor's strides, and a worker's shard can be laid out otherwise (a
    batch-1 shard that an earlier kernel wrote channels-last, with any stride on the batch), so
    the worker makes its own shard contiguous where it is not. (Channels-last shards are copied
    too: torch's format guess for a size-1 batch dim need not call them channels-last.)"""
    return aten.native_group_norm.default(x.contiguous(), *args)


def group_norm_rule(call):
    # native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean [N, group], rstd)
    rest = (R,) * (len(call.inputs) - 1)
    return [replicate_all(call), Strategy((S0,) + rest, (S0, S0, S0))]


def group_norm_backward_rule(call):
    # native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask)
    # -> (grad_input, grad_weight, grad_bias): linear in grad_out
    n_in = len(call.inputs)
    out = [replicate_all(call), Strategy((S0,) * 4 + (R,) * (n_in - 4), (S0, PSUM, PSUM))]
    for p in LINEAR_PARTIALS:
        out.append(Strategy((p,) + (R,) * (n_in - 1), (p, p, p)))
    return out


def local_batch_arg(index):
    """localize: the batch-size argument at ``args[index]`` (group norm's N) made the local one."""

    def localize(local):
        args = list(local.args)
        args[index] = local.in_regions[0][0][1]
        return tuple(args), local.kwargs

    return localize


def upsample_rule(call):
    # nearest upsampling copies values: batch and channel shards and every Partial pass through
    return dim_map_strategies(call, {0: 0, 1: 1}, partials=ALL_PARTIALS)


def upsample_backward_rule(call):
    # the gradient sums the copies: linear, so only sum-like Partials pass through
    return dim_map_strategies(call, {0: 0, 1: 1}, partials=LINEAR_PARTIALS)


def upsample_backward_localize(local):
    # upsample_nearest2d_backward(grad_output, output_size, input_size, ...): input_size is
    # the gradient's (N, C, H, W), local on a batch or channel shard
    args = list(local.args)
    args[2] = [n for _, n in local.out_regions[0]]
    return tuple(args), local.kwargs


def register(registry) -> None:
    registry.add(aten.convolution.default, convolution_rule)
    registry.add(aten.convolution_backward.default,
                 Rule(convolution_backward_rule, convolution_backward_localize))
    registry.add(aten.native_group_norm.default, Rule(group_norm_rule, local_batch_arg(3), GROUP_NORM_KERNEL))
    registry.add(aten.native_group_norm_backward.default, Rule(group_norm_backward_rule, local_batch_arg(5)))
    # no per-rank meta check: the output's batch and channel dims are the input's, so the local
    # shapes agree by construction, and torch's meta kernel of upsample_nearest2d fails on an
    # empty input (an empty batch shard) that the CPU and CUDA kernels take
    registry.add(aten.upsample_nearest2d.default, Rule(upsample_rule, check_local=False))
    registry.add(aten.upsample_nearest2d_backward.default, Rule(upsample_backward_rule, upsample_backward_localize))


def register_kernels(registry) -> None:
    registry.add(GROUP_NORM_KERNEL, native_group_norm_kernel)
