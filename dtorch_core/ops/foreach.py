"""``_foreach_*`` ops (what torch.optim uses): each list element is planned as the single op."""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten


def _element_op(name: str):
    base = name[len("_foreach_"):]
    if base.rstrip("_") == "norm":
        return aten.linalg_vector_norm
    return getattr(aten, base)


def foreach_decomposition(op, *args, **kwargs):
    """Run ``op`` as one call of its single-tensor op per list element."""
    schema = op._schema
    element = _element_op(schema.name.split("::")[1])
    length = next(len(a) for a in args if isinstance(a, (list, tuple)))
    list_positions = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    results = []
    for k in range(length):
        el_args = list(args)
        for i in list_positions:
            el_args[i] = args[i][k]
        if element is aten.linalg_vector_norm:
            ord_ = el_args[1] if len(el_args) > 1 else 2
            results.append(aten.linalg_vector_norm.default(el_args[0], ord_, None, False, dtype=kwargs.get("dtype")))
        else:
            el_args, el_kwargs = _split_kwarg_only(element, el_args, kwargs)
            results.append(element(*el_args, **el_kwargs))
    if not schema.returns:
        return None
    return results


def _split_kwarg_only(packet, args, kwargs):
    """Move trailing positional args that the single op takes keyword-only into kwargs
    (``_foreach_addcmul_`` takes ``value`` positionally, ``addcmul_`` only by keyword)."""
    best = None
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        if best is None or len(positional) > len(best[0]):
            best = (positional, [a.name for a in schema.arguments if a.kwarg_only])
    positional, kw_names = best
    if len(args) <= len(positional):
        return args, kwargs
    extra = args[len(positional):]
    return args[: len(positional)], dict(kwargs, **dict(zip(kw_names, extra)))


def register(registry) -> None:
    for name in dir(aten):
        if not name.startswith("_foreach_"):
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if overload == "out" or "out" in overload:
                continue
            try:
                _element_op(name)
            except AttributeError:
                continue
            registry.add_decomposition(op, functools.partial(foreach_decomposition, op))
