"""``_foreach_*`` ops (what torch.optim uses): one planned call for the whole list.

The elementwise ops are planned with their rule (``foreach_rule``): one worker call of the aten
foreach op over the local shards of every element. ``_foreach_norm`` has its own short plan
(``foreach_norm``). What neither can serve (list elements that are not DTensors or live on
different meshes, ``scalars`` given as a DTensor, norm orders without an identity) runs as one
call of the single-tensor op per list element, as it always did.
"""

from __future__ import annotations

import functools

import torch

from ..tensor import DTensor
from .foreach_norm import foreach_norm
from .foreach_plan import NOT_PLANNED, run_foreach
from .foreach_rule import is_elementwise

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
    """Plan ``op`` as one call where its rule or the norm plan can, else element by element."""
    if op is aten._foreach_norm.Scalar:
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        out = foreach_norm(op, args[0] if args else kwargs.get("self"), ord_, dtype)
        if out is not None:
            return out
    elif is_elementwise(op) and (session := _servable(op, args, kwargs)) is not None:
        op_, args_, kwargs_ = _scalar_tensor_as_list(op, args, kwargs)
        rule = session.ops.rule_for(op_)
        if rule is not None:
            out = run_foreach(session, op_, args_, kwargs_, rule)
            if out is not NOT_PLANNED:
                return out
    return per_element(op, *args, **kwargs)


def _servable(op, args, kwargs):
    """The session, if the rule serves this call: every list element a DTensor, all on one mesh,
    lists of one length, and no ``scalars`` DTensor (its values would have to be read)."""
    names = _argument_names(op)
    mesh = session = None
    length = None
    for i, v in enumerate(list(args) + list(kwargs.values())):
        name = names[i] if i < len(args) else list(kwargs)[i - len(args)]
        if type(v) in (list, tuple) and v and isinstance(v[0], torch.Tensor):
            if length is None:
                length = len(v)
            elif len(v) != length:
                return None
            items = v
        elif isinstance(v, torch.Tensor):
            if name == "scalars" and type(v) is DTensor:
                return None
            if type(v) is not DTensor:
                continue
            items = (v,)
        else:
            continue
        for t in items:
            if type(t) is not DTensor:
                return None
            if mesh is None:
                mesh, session = t._spec.mesh, t._handle.session
            elif t._spec.mesh is not mesh and t._spec.mesh != mesh:
                return None
    return session if mesh is not None else None


@functools.cache
def _argument_names(op) -> list:
    return [a.name for a in op._schema.arguments]


def _scalar_tensor_as_list(op, args, kwargs):
    """A plain ``Tensor scalars`` (one value per element) as the ``ScalarList`` overload: the
    foreach kernels read it on the host."""
    names = _argument_names(op)
    if "scalars" not in names or op._overloadname != "Tensor":
        return op, args, kwargs
    i = names.index("scalars")
    args = list(args)
    if i < len(args) and isinstance(args[i], torch.Tensor):
        args[i] = args[i].tolist()
    elif isinstance(kwargs.get("scalars"), torch.Tensor):
        kwargs = dict(kwargs, scalars=kwargs["scalars"].tolist())
    else:
        return op, tuple(args), kwargs
    return op.overloadpacket.ScalarList, tuple(args), kwargs


def per_element(op, *args, **kwargs):
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
    for schema in torch._C._jit_get_all_schemas():
        name, overload = schema.name, schema.overload_name
        if not name.startswith("aten::_foreach_") or "out" in overload:
            continue
        name = name[len("aten::"):]
        op = getattr(getattr(aten, name), overload or "default")
        try:
            _element(name, op._overloadname)
        except AttributeError:
            continue  # no single-tensor op to fall back on: the rule alone (foreach_rule) serves it
        decomposition = functools.partial(foreach_decomposition, op)
        # numbers in the call (Scalar, Scalar[]): torch.optim's change every step; run_foreach
        # keeps its plans without them, so the dispatcher's cache does not keep one per value
        decomposition.cache_plan = not any(str(a.type) in ("number", "List[number]") for a in op._schema.arguments)
        registry.add_decomposition(op, decomposition)
