"""Joining and indexing: cat, stack, index_select, gather, scatter(_add), index_add, advanced
indexing (``x[i, j]``: index.Tensor) and its backward (index_put), isin."""

from __future__ import annotations

import torch

from ..placement import Shard
from ..planner.schema import Strategy
from .common import (
    ALL_PARTIALS,
    LINEAR_PARTIALS,
    R,
    add_all,
    dim_map_strategies,
    replicate_all,
)

aten = torch.ops.aten


def _norm(d, nd):
    return d % nd if nd else 0


def cat_rule(call):
    out = call.outputs[0]
    nd = out.ndim
    dim = _norm(call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0), nd)
    n = len(call.inputs)
    strategies = [replicate_all(call)]
    for d in range(nd):
        if d == dim:
            continue
        ins = tuple(Shard(d) if t.ndim == nd else R for t in call.inputs)  # legacy empty 1-D inputs
        strategies.append(Strategy(ins, (Shard(d),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p,) * n, (p,)))
    return strategies


def stack_rule(call):
    x = call.inputs[0]
    dim = _norm(call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0), x.ndim + 1)
    n = len(call.inputs)
    strategies = [replicate_all(call)]
    for d in range(x.ndim):
        strategies.append(Strategy((Shard(d),) * n, (Shard(d if d < dim else d + 1),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p,) * n, (p,)))
    return strategies


def index_select_rule(call):
    x = call.inputs[0]
    dim = _norm(call.args[1], x.ndim)
    strategies = [replicate_all(call)]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(Strategy((Shard(d), R), (Shard(d),)))
    if call.inputs[1].ndim == 1:
        strategies.append(Strategy((R, Shard(0)), (Shard(dim),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p, R), (p,)))
    return strategies


def gather_rule(call):
    x, index = call.inputs[0], call.inputs[1]
    dim = _norm(call.args[1], x.ndim)
    strategies = [replicate_all(call)]
    for d in range(x.ndim):
        if d == dim:
            strategies.append(Strategy((R, Shard(d)), (Shard(d),)))
        elif x.shape[d] == index.shape[d]:
            strategies.append(Strategy((Shard(d), Shard(d)), (Shard(d),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p, R), (p,)))
    return strategies


def scatter_rule(call):
    # scatter/scatter_add(self, dim, index, src|value): dims other than ``dim`` with equal sizes
    # shard together; with a tensor src the op is linear in (self, src) taken together
    x = call.inputs[0]
    n = len(call.inputs)
    dim = _norm(call.args[1], x.ndim)
    strategies = [replicate_all(call)]
    for d in range(x.ndim):
        if d != dim and all(t.ndim == x.ndim and t.shape[d] == x.shape[d] for t in call.inputs):
            strategies.append(Strategy((Shard(d),) * n, (Shard(d),)))
    if n == 3 and "reduce" not in call.kwargs and len(call.args) < 5:
        for p in LINEAR_PARTIALS:
            strategies.append(Strategy((p, R, p), (p,)))
    return strategies


def index_add_rule(call):
    # index_add(self, dim, index, source, alpha): every dim but ``dim`` shards self and source
    x = call.inputs[0]
    dim = _norm(call.args[1], x.ndim)
    strategies = [replicate_all(call)]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(Strategy((Shard(d), R, Shard(d)), (Shard(d),)))
    for p in LINEAR_PARTIALS:
        strategies.append(Strategy((p, R, p), (p,)))
    return strategies


def _unindexed_dims(x_ndim: int, indices) -> list[tuple[int, int]]:
    """(dim of self, dim of the result) for the dims no index tensor selects, by torch's rule:
    the broadcast index dims replace adjacent indexed dims in place, and go first otherwise."""
    present = [i for i, t in enumerate(indices) if t is not None]
    if not present:
        return []
    k = max(t.ndim for t in indices if t is not None)
    adjacent = present == list(range(present[0], present[-1] + 1))
    pairs = []
    for d in range(x_ndim):
        if d in present:
            continue
        if adjacent:
            pairs.append((d, d if d < present[0] else d - len(present) + k))
        else:
            pairs.append((d, k + d - sum(1 for p in present if p < d)))
    return pairs


def index_rule(call):
    # x[i0, i1, ...] with integer index tensors: a dim that no index selects keeps its shard (the
    # index tensors are replicated: they hold global positions); indexing is linear in x
    x, indices = call.inputs[0], call.args[1]
    rest = (R,) * (len(call.inputs) - 1)
    strategies = [replicate_all(call)]
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return strategies  # a mask's result size depends on its values
    for d, od in _unindexed_dims(x.ndim, indices):
        strategies.append(Strategy((Shard(d),) + rest, (Shard(od),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p,) + rest, (p,)))
    return strategies


def index_put_rule(call):
    # index_put(self, indices, values, accumulate): self and values shard together on a dim that
    # no index selects (values laid out like x[indices]); linear in (self, values) together
    x, indices = call.inputs[0], call.args[1]
    values = call.inputs[-1]
    middle = (R,) * (len(call.inputs) - 2)
    strategies = [replicate_all(call)]
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return strategies
    k = max((t.ndim for t in indices if t is not None), default=0)
    result_ndim = x.ndim - sum(1 for t in indices if t is not None) + k
    for d, od in _unindexed_dims(x.ndim, indices):
        vd = od - (result_ndim - values.ndim)  # values broadcast against x[indices] from the right
        if vd >= 0 and values.shape[vd] == x.shape[d]:
            strategies.append(Strategy((Shard(d),) + middle + (Shard(vd),), (Shard(d),)))
    for p in LINEAR_PARTIALS:
        strategies.append(Strategy((p,) + middle + (p,), (p,)))
    return strategies


def isin_rule(call):
    # isin(elements, test_elements): elementwise in ``elements`` (any dim sharded) against the
    # whole set of test elements (replicated)
    return dim_map_strategies(call, {d: d for d in range(call.inputs[0].ndim)}, partials=())


def register(registry) -> None:
    registry.add(aten.cat.default, cat_rule, replace=True)
    registry.add(aten.stack.default, stack_rule, replace=True)
    registry.add(aten.index_select.default, index_select_rule, replace=True)
    registry.add(aten.gather.default, gather_rule, replace=True)
    for packet in (aten.scatter_add, aten.scatter_add_, aten.scatter, aten.scatter_):
        add_all(registry, packet, scatter_rule)
    registry.add(aten.index.Tensor, index_rule, replace=True)
    registry.add(aten.isin.Tensor_Tensor, isin_rule, replace=True)
    registry.add(aten.isin.Tensor_Scalar, isin_rule, replace=True)
    for packet in (aten.index_put, aten.index_put_):
        add_all(registry, packet, index_put_rule)
    for packet in (aten.index_add, aten.index_add_):
        add_all(registry, packet, index_add_rule)
