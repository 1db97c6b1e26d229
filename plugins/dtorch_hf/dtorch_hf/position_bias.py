"""T5's relative position bias as one op: ``dtorch_hf::t5_position_bias``.

transformers' ``T5Attention.compute_bias`` builds the (query, key) relative positions with
``arange``s on the bias weight's device, buckets them (about a dozen elementwise ops) and looks
the buckets up in ``relative_attention_bias``. On a distributed model those positions are plain
tensors made on the controller (on a GPU: the controller's own device) that then meet the
distributed weight: each call sends them to the workers, and a GPU tensor is copied to the host
first, which waits for the controller's stream; ``generate`` does it at every new token. Here the
workers compute the whole bias from the sizes: transformers' own bucketing on their device, then
the lookup in their shard of the weight, so the values are transformers' values. The rule: the
weight replicated, or split by heads (the tp plan's Shard(1)) with the bias split by heads too.
Where the weight needs a gradient (training), transformers' code runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("t5_position_bias(Tensor weight, SymInt query_length, SymInt key_length, SymInt past, "
               "bool bidirectional, int num_buckets, int max_distance) -> Tensor")


def t5_position_bias_kernel(weight, query_length, key_length, past, bidirectional, num_buckets, max_distance):
    """The (1, heads, query_length, key_length) bias of ``weight`` ((buckets, heads)), as
    ``T5Attention.compute_bias`` computes it."""
    from transformers.models.t5.modeling_t5 import T5Attention

    context = torch.arange(query_length, dtype=torch.long, device=weight.device)[:, None] + past
    memory = torch.arange(key_length, dtype=torch.long, device=weight.device)[None, :]
    buckets = T5Attention._relative_position_bucket(memory - context, bidirectional=bidirectional,
                                                    num_buckets=num_buckets, max_distance=max_distance)
    return F.embedding(buckets, weight).permute([2, 0, 1]).unsqueeze(0)


LIBRARY.impl("t5_position_bias", t5_position_bias_kernel, "CompositeExplicitAutograd")
t5_position_bias_op = torch.ops.dtorch_hf.t5_position_bias.default


def t5_position_bias_strategies(call):
    """weight (buckets, heads) -> (1, heads, queries, keys)."""
    return [Strategy((R,), (R,)), Strategy((Shard(1),), (Shard(1),))]


def one_op_compute_bias(attention):
    """``attention.compute_bias`` (a transformers ``T5Attention`` with a relative attention
    bias): the one op where its weight is a DTensor that needs no gradient here."""
    original = attention.compute_bias

    def compute_bias(query_length, key_length, device=None, past_seen_tokens=0):
        weight = attention.relative_attention_bias.weight
        if type(weight) is not dt.DTensor or (torch.is_grad_enabled() and weight.requires_grad) \
                or not isinstance(past_seen_tokens, int):
            return original(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)
        return t5_position_bias_op(weight, query_length, key_length, past_seen_tokens, not attention.is_decoder,
                                   attention.relative_attention_num_buckets, attention.relative_attention_max_distance)

    return compute_bias


def one_op_position_biases(model) -> None:
    """Give every T5 attention of ``model`` that has a relative attention bias the one-op bias."""
    from transformers.models.t5.modeling_t5 import T5Attention

    for module in model.modules():
        if type(module) is T5Attention and module.has_relative_attention_bias:
            module.compute_bias = one_op_compute_bias(module)


def register(registry) -> None:
    registry.add(t5_position_bias_op, Rule(t5_position_bias_strategies, kernel="dtorch_hf::t5_position_bias"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::t5_position_bias", t5_position_bias_kernel)
