"""Elementwise ops: every aten op tagged ``pointwise``, with linearity for Partial inputs."""

from __future__ import annotations

import functools

import torch

from .common import ALL_PARTIALS, LINEAR_PARTIALS, R, add_all, pointwise_strategies
from ..planner.schema import Strategy

aten = torch.ops.aten

# input-index groups in which an op is linear (see pointwise_strategies)
LINEAR = {
    "add": [{0, 1}],
    "sub": [{0, 1}],
    "mul": [{0}, {1}],
    "div": [{0}],
    "neg": [{0}],
    "positive": [{0}],
    "clone": [{0}],
    "alias": [{0}],
    "detach": [{0}],
    "_to_copy": [{0}],
    "real": [{0}],
    "where": [{1, 2}],
    "threshold_backward": [{0}],
    "gelu_backward": [{0}],
    "silu_backward": [{0}],
    "tanh_backward": [{0}],
    "sigmoid_backward": [{0}],
    "native_dropout_backward": [{0}],
    "copy": [{0, 1}],
    "rsub": [{0, 1}],
    "leaky_relu_backward": [{0}],
    "hardtanh_backward": [{0}],
    "elu_backward": [{0}],
    "softplus_backward": [{0}],
    "hardswish_backward": [{0}],
    "hardsigmoid_backward": [{0}],
}
# elementwise ops that lack the ``pointwise`` tag (in some torch versions: leaky_relu before 2.13)
UNTAGGED = ("floor_divide", "floor_divide_", "rsub", "hardswish", "hardswish_", "leaky_relu", "leaky_relu_",
            "leaky_relu_backward",
            "hardtanh_backward", "elu_backward", "softplus_backward", "hardswish_backward",
            "hardsigmoid_backward")
# ops whose Partial(max)/Partial(min) inputs pass through unchanged (values are not changed)
VALUE_PRESERVING = {"clone", "alias", "detach", "_to_copy"}


def all_aten_overloads():
    seen = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        try:
            op = getattr(getattr(aten, schema.name[6:]), schema.overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        if op not in seen:
            seen.add(op)
            yield op


def _linear_groups(op):
    base = op._schema.name[6:].rstrip("_")
    groups = LINEAR.get(base, [])
    if base in ("add", "sub", "rsub") and op._overloadname not in ("Tensor", "out"):
        return []  # adding a scalar to each partial value is not linear
    if base == "mul" and op._overloadname == "Scalar":
        return [{0}]
    return groups


def _is_float(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _call_partials(call, partials):
    """Partial placements that stay valid for this call (static arguments and dtypes decide)."""
    if call.kwargs.get("rounding_mode") is not None:
        return ()  # floor/trunc division rounds each partial value: not linear
    dst = next((o.dtype for o in call.outputs if o is not None), None)
    if dst is not None and not _is_float(dst) and any(_is_float(t.dtype) for t in call.inputs):
        # rounding to an integer is monotone (max/min survive) but not linear; bool is neither
        if dst == torch.bool:
            return ()
        return tuple(p for p in partials if p.reduce_op in ("max", "min"))
    return partials


def pointwise_rule(op):
    groups = _linear_groups(op)
    base = op._schema.name[6:].rstrip("_")
    partials = ALL_PARTIALS if base in VALUE_PRESERVING else LINEAR_PARTIALS
    return functools.partial(_pointwise, groups=groups, partials=partials)


def _pointwise(call, groups, partials):
    return pointwise_strategies(call, linear=groups or _call_groups(call), partial_ops=_call_partials(call, partials))


def _call_groups(call):
    """Linearity that depends on the static arguments of this call."""
    op = call.op
    if op.overloadpacket in (aten.masked_fill, aten.masked_fill_):
        if op._overloadname.startswith("Tensor"):
            return [{0, 2}]  # where(mask, value, self): linear in self and value together
        value = call.args[2] if len(call.args) > 2 else call.kwargs.get("value")
        if isinstance(value, (int, float, bool)) and value == 0:
            return [{0}]  # filling zeros keeps a sum of partial values
    return []


def like_rule(call):
    """``*_like`` factories: the output takes the input's sharding; values come from nothing."""
    x = call.inputs[0]
    out = [Strategy((R,) * len(call.inputs), (R,))]
    from ..placement import Partial, Shard

    for d in range(x.ndim):
        out.append(Strategy((Shard(d),) + (R,) * (len(call.inputs) - 1), (Shard(d),)))
    for op in ("sum", "avg", "max", "min"):
        out.append(Strategy((Partial(op),) + (R,) * (len(call.inputs) - 1), (R,)))
    return out


def new_factory_rule(call):
    """``new_zeros`` and friends: a replicated result whatever the input's placement."""
    from ..placement import Partial, Shard

    x = call.inputs[0]
    choices = [R] + [Shard(d) for d in range(x.ndim)] + [Partial(o) for o in ("sum", "avg", "max", "min")]
    return [Strategy((p,) + (R,) * (len(call.inputs) - 1), (R,) * len(call.outputs)) for p in choices]


def zero_rule(call):
    """``zero_``: zeros are zeros under every placement."""
    from ..placement import Partial, Shard

    x = call.inputs[0]
    choices = [R] + [Shard(d) for d in range(x.ndim)] + [Partial(o) for o in ("sum", "avg", "max", "min")]
    return [Strategy((p,), (p,)) for p in choices]


def fill_rule(call):
    from ..placement import Shard

    x = call.inputs[0]
    choices = [R] + [Shard(d) for d in range(x.ndim)]
    n = len(call.inputs)
    return [Strategy((p,) + (R,) * (n - 1), (p,)) for p in choices]


def register(registry) -> None:
    for op in all_aten_overloads():
        tags = op.tags
        if torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags:
            registry.add(op, pointwise_rule(op))
    for name in UNTAGGED:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            registry.add(op, pointwise_rule(op), replace=True)
    for packet in (aten.clone, aten.alias, aten.detach, aten._to_copy, aten.copy_, aten.copy,
                   aten.lift_fresh, aten.positive, aten._conj, aten.masked_fill, aten.masked_fill_,
                   aten.where, aten.native_dropout_backward):
        for name in packet.overloads():
            op = getattr(packet, name)
            registry.add(op, pointwise_rule(op), replace=True)
    for packet in (aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like):
        add_all(registry, packet, like_rule)
    for packet in (aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.new_empty_strided):
        add_all(registry, packet, new_factory_rule)
    registry.add(aten.zero_.default, zero_rule, replace=True)
    registry.add(aten.fill_.Scalar, fill_rule, replace=True)
    registry.add(aten.fill_.Tensor, fill_rule, replace=True)
