"""The joint attention's layout as one op each side of SDPA: ``dtorch_hf::joint_heads`` and
``dtorch_hf::stream_outputs``.

SD3's and Flux's processors (families/) hold each stream's q, k and v as (batch, seq, heads,
head_dim). Before SDPA the streams are concatenated along the sequence, Flux rotates q and k
(RoPE), and each of q, k and v is transposed to (batch, heads, seq, head_dim): six to eight
dispatches on the controller. After it the output is transposed back and split into the streams.
In inference on a distributed model each side is one op whose kernel is those steps on each
worker's shard, so the values are the same; SDPA itself stays its own op (an attention-kernel
plugin serves it). The rule follows the layout: the batch or the heads may be split (Ulysses has
moved the sequence to whole by then), the sequence and head_dim not. With gradients, autocast
or plain tensors the steps run as separate ops, and so does a single stream's value (its
transpose is a view: an op's output may not be a view of its input).
"""

from __future__ import annotations

import torch

from dtorch_core.placement import Replicate, Shard
from dtorch_core.planner.schema import Rule, Strategy

from .modulate import one_op_applies
from .rotary import rotary

R = Replicate()
LIBRARY = torch.library.Library("dtorch_hf", "FRAGMENT")
LIBRARY.define("joint_heads(Tensor[] q, Tensor[] k, Tensor[] v, Tensor? cos, Tensor? sin) -> Tensor[]")
LIBRARY.define("stream_outputs(Tensor out, SymInt[] lengths) -> Tensor[]")


def _joined(parts, tables):
    x = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if tables is not None and x.numel():  # an empty shard (no heads here) has nothing to rotate
        from diffusers.models.embeddings import apply_rotary_emb

        x = apply_rotary_emb(x, tables, sequence_dim=1)
    return x.transpose(1, 2)


def joint_heads_kernel(q, k, v, cos, sin):
    """q, k, v of the streams ((batch, seq_i, heads, head_dim) each) joined along the sequence,
    q and k rotated by the (seq, head_dim) tables where given, as (batch, heads, seq, head_dim);
    without v (an empty list) q and k alone."""
    tables = None if cos is None else (cos, sin)
    return [_joined(q, tables), _joined(k, tables)] + ([_joined(v, None)] if v else [])


def stream_outputs_kernel(out, lengths):
    """SDPA's (batch, heads, seq, head_dim) output as one contiguous (batch, length, heads,
    head_dim) tensor per stream."""
    parts, start = [], 0
    for length in lengths:
        parts.append(out[:, :, start:start + length].transpose(1, 2).contiguous())
        start += length
    return parts


LIBRARY.impl("joint_heads", joint_heads_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("stream_outputs", stream_outputs_kernel, "CompositeExplicitAutograd")
joint_heads_op = torch.ops.dtorch_hf.joint_heads.default
stream_outputs_op = torch.ops.dtorch_hf.stream_outputs.default


def joint_heads_strategies(call):
    """The streams (batch, seq, heads, head_dim), the tables (seq, head_dim) -> (batch, heads,
    seq, head_dim) each."""
    tables = (R,) * (2 if call.args[3] is not None else 0)
    streams, n = len(call.inputs) - len(tables), len(call.outputs)
    return [Strategy((R,) * len(call.inputs), (R,) * n),
            Strategy((Shard(0),) * streams + tables, (Shard(0),) * n),
            Strategy((Shard(2),) * streams + tables, (Shard(1),) * n)]


def stream_outputs_strategies(call):
    """(batch, heads, seq, head_dim) -> (batch, length, heads, head_dim) per stream."""
    n = len(call.outputs)
    return [Strategy((R,), (R,) * n), Strategy((Shard(0),), (Shard(0),) * n), Strategy((Shard(1),), (Shard(2),) * n)]


def joint_heads(queries: list, keys: list, values: list, tables=None) -> tuple:
    """The (batch, heads, seq, head_dim) query, key and value of the joint sequence of the
    streams (lists of (batch, seq_i, heads, head_dim) tensors), q and k rotated by ``tables``
    ((cos, sin), over the joint sequence) where given."""
    if one_op_applies(queries[0]) and (len(queries) > 1 or tables is not None):
        cos, sin = tables if tables is not None else (None, None)
        if len(queries) > 1:
            return tuple(joint_heads_op(queries, keys, values, cos, sin))
        q, k = joint_heads_op(queries, keys, [], cos, sin)  # one stream's value needs no op
        return q, k, values[0].transpose(1, 2)
    q, k, v = (torch.cat(ts, dim=1) if len(ts) > 1 else ts[0] for ts in (queries, keys, values))
    if tables is not None:
        q, k = rotary(q, tables), rotary(k, tables)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def stream_outputs(out, lengths: list) -> list:
    """SDPA's (batch, heads, seq, head_dim) output of the joint sequence as one (batch,
    length, heads, head_dim) tensor per stream (``lengths``)."""
    if one_op_applies(out) and len(lengths) > 1:
        return list(stream_outputs_op(out, list(lengths)))
    out = out.transpose(1, 2)
    return list(out.split_with_sizes(lengths, dim=1)) if len(lengths) > 1 else [out]


def register(registry) -> None:
    registry.add(joint_heads_op, Rule(joint_heads_strategies, kernel="dtorch_hf::joint_heads"))
    registry.add(stream_outputs_op, Rule(stream_outputs_strategies, kernel="dtorch_hf::stream_outputs"))


def register_kernels(registry) -> None:
    registry.add("dtorch_hf::joint_heads", joint_heads_kernel)
    registry.add("dtorch_hf::stream_outputs", stream_outputs_kernel)
