"""Reductions: sum, mean, amax/amin, max/min, prod, var/std, norm, argmax/argmin, ..."""

from __future__ import annotations

import torch

from ..placement import Partial, Shard
from .common import R, add_all, replicate_all
from ..planner.schema import Rule, Strategy
from ..tensor import DTensor
from ..planner.dispatch import dispatch_direct

aten = torch.ops.aten


def _reduced_dims(ndim, dims):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % ndim for d in dims} if ndim else set()


def _arg(call, index, name, default):
    if name in call.kwargs:
        return call.kwargs[name]
    return call.args[index] if len(call.args) > index else default


def reduction(dim_index=1, keepdim_index=2, partial=None, passthrough=()):
    """Rule for a reduction of input 0 over the dims at ``args[dim_index]`` (None: all dims).

    ``partial``: placement the output takes when a reduced dim is sharded (None: not allowed).
    ``passthrough``: Partial inputs that stay Partial through the reduction.
    """

    def strategies(call):
        x = call.inputs[0]
        nd = x.ndim
        dims = _arg(call, dim_index, "dim", None) if dim_index is not None else None
        if keepdim_index == "keep":
            keepdim = True
        else:
            keepdim = bool(_arg(call, keepdim_index, "keepdim", False)) if keepdim_index is not None else False
        red = _reduced_dims(nd, dims)
        n_in, n_out = len(call.inputs), len(call.outputs)
        rest = (R,) * (n_in - 1)
        out = [replicate_all(call)]
        for d in range(nd):
            if d in red:
                if partial is not None and x.shape[d] > 0:
                    out.append(Strategy((Shard(d),) + rest, (partial,) * n_out))
            else:
                od = d if keepdim else d - sum(1 for r in red if r < d)
                out.append(Strategy((Shard(d),) + rest, (Shard(od),) * n_out))
        for p in passthrough:
            out.append(Strategy((p,) + rest, (p,) * n_out))
        return out

    return strategies


def mean_localize(local):
    """Pass the global count of reduced elements so each rank divides by it."""
    spec = local.in_specs[0]
    args = list(local.args)
    dims = args[1] if len(args) > 1 else local.kwargs.get("dim")
    red = _reduced_dims(len(spec.shape), dims)
    count = 1
    for d in red:
        count *= spec.shape[d]
    kwargs = dict(local.kwargs)
    kwargs["count"] = count
    return tuple(args), kwargs


def norm_decomposition(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """Vector norms over sharded or Partial inputs through sums/maxima that reduce exactly."""
    spec = x._spec if isinstance(x, DTensor) else None
    red = _reduced_dims(x.ndim, dim)
    needs_split = spec is not None and (
        spec.has_partial() or any(isinstance(p, Shard) and p.dim in red for p in spec.placements)
    )
    if not needs_split:
        return dispatch_direct(aten.linalg_vector_norm.default, (x, ord, dim, keepdim), {"dtype": dtype})
    # Partial inputs: abs() below reduces them (reduce-scatter where that is cheaper)
    if dtype is not None:
        x = aten._to_copy.default(x, dtype=dtype)
    dims = sorted(red)
    a = aten.abs.default(x)
    if ord == float("inf"):
        return aten.amax.default(a, dims, keepdim)
    if ord == float("-inf"):
        return aten.amin.default(a, dims, keepdim)
    if ord == 0:
        nz = aten._to_copy.default(aten.ne.Scalar(x, 0), dtype=x.dtype)
        return aten.sum.dim_IntList(nz, dims, keepdim)
    if ord == 1:
        return aten.sum.dim_IntList(a, dims, keepdim)
    s = aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, ord), dims, keepdim)
    return aten.pow.Tensor_Scalar(s, 1.0 / ord)


def aten_norm_decomposition(x, p=2, dim=None, keepdim=False, *, dtype=None):
    """``aten.norm`` (the legacy overloads): the vector norm of the same order."""
    if dim is not None and len(dim) == 0:
        dim = None
    return norm_decomposition(x, 2 if p is None else p, dim, keepdim, dtype=dtype)


def register(registry) -> None:
    linear = (Partial("sum"), Partial("avg"))
    add_all(registry, aten.sum, reduction(1, 2, Partial("sum"), linear))
    registry.add(aten.sum.default, reduction(None, None, Partial("sum"), linear), replace=True)
    for name in aten.mean.overloads():
        op = getattr(aten.mean, name)
        rule = reduction(None, None, Partial("sum"), linear) if name == "default" else reduction(
            1, 2, Partial("sum"), linear)
        registry.add(op, Rule(rule, mean_localize if name != "default" else _mean_all_localize,
                              "dtorch::mean"), replace=True)
    add_all(registry, aten.amax, reduction(1, 2, Partial("max"), (Partial("max"),)))
    add_all(registry, aten.amin, reduction(1, 2, Partial("min"), (Partial("min"),)))
    registry.add(aten.max.default, reduction(None, None, Partial("max"), (Partial("max"),)), replace=True)
    registry.add(aten.min.default, reduction(None, None, Partial("min"), (Partial("min"),)), replace=True)
    # max()/min() fail on an empty shard and their meta kernels do not say so: plan them as
    # amax/amin over every dim, whose meta check rejects placements that leave a shard empty
    registry.add_decomposition(aten.max.default, lambda x: aten.amax.default(x, []))
    registry.add_decomposition(aten.min.default, lambda x: aten.amin.default(x, []))
    for packet in (aten.max, aten.min):
        registry.add(packet.dim, reduction(1, 2), replace=True)
    for packet in (aten.argmax, aten.argmin, aten.logsumexp, aten.any, aten.all, aten.count_nonzero,
                   aten.nansum):
        add_all(registry, packet, reduction(1, 2))
    # cumsum keeps every dim: its "reduced" dim must simply not be sharded
    add_all(registry, aten.cumsum, reduction(1, "keep"))
    add_all(registry, aten.cumprod, reduction(1, "keep"))
    add_all(registry, aten.prod, reduction(1, 2))
    registry.add(aten.prod.default, reduction(None, None), replace=True)
    for packet in (aten.var, aten.std, aten.var_mean, aten.std_mean):
        for name in packet.overloads():
            registry.add(getattr(packet, name), reduction(1, 3), replace=True)
    add_all(registry, aten.linalg_vector_norm, reduction(2, 3))
    registry.add_decomposition(aten.linalg_vector_norm.default, norm_decomposition)
    for name in ("Scalar", "ScalarOpt_dim", "ScalarOpt_dtype", "ScalarOpt_dim_dtype"):
        registry.add_decomposition(getattr(aten.norm, name), aten_norm_decomposition, replace=True)


def _mean_all_localize(local):
    spec = local.in_specs[0]
    count = 1
    for n in spec.shape:
        count *= n
    return local.args, dict(local.kwargs, count=count)
