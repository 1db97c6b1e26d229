"""``_foreach_*`` ops (what torch.optim uses): each list element is planned as the single op."""

from __future__ import annotations

import functools

import torch
from ..tensor import DTensor

aten = torch.ops.aten

# foreach ops whose single-tensor op has another name (maximum/minimum take no Scalar)
_SCALAR_RENAMES = {"maximum": "clamp_min", "minimum": "clamp_max"}


def _element(name: str, overload: str):
    """(single-tensor packet, writes back) for ``_foreach_<name>.<overload>``.

    ``writes back``: the foreach op is in place but the single op has no in-place form
    (``maximum_``), so the result of the out-of-place op is copied into ``self``.
    """
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    core = base.rstrip("_")
    if core == "norm":
        return aten.linalg_vector_norm, False
    if overload.startswith("Scalar") and core in _SCALAR_RENAMES:
        core = _SCALAR_RENAMES[core]
    if inplace:
        packet = getattr(aten, core + "_", None)
        if packet is not None:
            return packet, False
        return getattr(aten, core), True
    return getattr(aten, core), False


def _scalars(value):
    """A ``Tensor scalars`` argument (one value per list element) as Python numbers."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.tolist()


def foreach_decomposition(op, *args, **kwargs):
    """Run ``op`` as one call of its single-tensor op per list element."""
    schema = op._schema
    element, write_back = _element(schema.name.split("::")[1], op._overloadname)
    names = [a.name for a in schema.arguments]
    args = list(args)
    for i, a in enumerate(args):
        if i < len(names) and names[i] == "scalars" and isinstance(a, torch.Tensor):
            args[i] = _scalars(a)
    length = next(len(a) for a in args if isinstance(a, (list, tuple)))
    list_positions = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    results = []
    for k in range(length):
        el_args = list(args)
        for i in list_positions:
            el_args[i] = args[i][k]
        if element is aten.linalg_vector_norm:
            # _foreach_norm(self, ord=2, dtype=None): dtype may come positionally
            ord_ = el_args[1] if len(el_args) > 1 else kwargs.get("ord", 2)
            dtype = el_args[2] if len(el_args) > 2 else kwargs.get("dtype")
            results.append(aten.linalg_vector_norm.default(el_args[0], ord_, None, False, dtype=dtype))
            continue
        el_args, el_kwargs = _split_kwarg_only(element, el_args, kwargs)
        out = element(*el_args, **el_kwargs)
        if write_back:
            aten.copy_.default(el_args[0], out)
            out = el_args[0]
        results.append(out)
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
                _element(name, overload)
            except AttributeError:
                continue
            registry.add_decomposition(op, functools.partial(foreach_decomposition, op))
