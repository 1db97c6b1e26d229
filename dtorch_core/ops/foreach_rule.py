"""The sharding rule of the elementwise ``_foreach_*`` ops: one worker call for a whole list.

Per list position ``k`` the op is the single-tensor pointwise op, so element ``k`` of every tensor
list takes one placement per mesh dim (the cheapest to reach, the written list's own where the op
is in place, as a pointwise op would choose) and the output element ``k`` gets it. Elements of
one list may be placed differently and shard unevenly: the local call on each rank is the aten
foreach op over its local shards of every element. ``Tensor`` scalar arguments are Replicate.

The rule needs the inputs' current placements (``OpCall.specs``): choosing per element from a
list of whole-op strategies would need one strategy per combination of element placements.
"""

from __future__ import annotations

import torch

from ..placement import Shard
from ..planner.schema import Rule, Strategy
from ..redistribute import redistribute_cost
from .common import ALL_PARTIALS, LINEAR_PARTIALS, R

aten = torch.ops.aten

# ops that are not elementwise per position (reductions, products): not served by this rule
NOT_ELEMENTWISE = frozenset({"norm", "max", "mm", "powsum"})

# foreach core name -> overload -> groups of schema argument positions (tensor lists) in which
# the op is linear together, so Partial elements stay Partial (see pointwise_strategies)
LINEAR = {
    "add": {"List": [{0, 1}]},
    "sub": {"List": [{0, 1}]},
    "mul": {"Scalar": [{0}], "ScalarList": [{0}], "Tensor": [{0}], "List": [{0}, {1}]},
    "div": {"Scalar": [{0}], "ScalarList": [{0}], "Tensor": [{0}], "List": [{0}]},
    "neg": {"default": [{0}]},
    "clone": {"default": [{0}]},
    "copy": {"default": [{0, 1}]},
    "zero": {"default": [{0}]},
    # (1 - w) a + w b: linear in a and b together for a number w
    "lerp": {"Scalar": [{0, 1}], "ScalarList": [{0, 1}]},
}
# ops that keep values as they are: Partial(max)/(min) pass too
VALUE_PRESERVING = frozenset({"clone", "zero"})


def core_name(op) -> str:
    """``aten._foreach_add_.List`` -> ``"add"``."""
    return op._schema.name.split("::")[1][len("_foreach_"):].rstrip("_")


def is_elementwise(op) -> bool:
    return core_name(op) not in NOT_ELEMENTWISE


def _layout(call):
    """Flat input indices of each tensor-list argument (by schema position) and of the single
    tensors (Tensor scalars), in the order the planner numbers the inputs."""
    lists, singles = [], []
    counter = 0
    values = list(call.args) + list(call.kwargs.values())
    for pos, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            singles.append(counter)
            counter += 1
        elif type(v) in (list, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            lists.append((pos, list(range(counter, counter + len(v)))))
            counter += len(v)
    return lists, singles


def foreach_strategies(call):
    """Per mesh dim one strategy made of the per-element choices on that dim, and all-Replicate."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    replicate = Strategy((R,) * n_in, (R,) * n_out)
    specs = call.specs
    if not specs:
        return [replicate]
    lists, _ = _layout(call)
    if not lists:
        return [replicate]
    length = len(lists[0][1])
    if any(len(idx) != length for _, idx in lists) or (n_out and n_out != length):
        return [replicate]
    core = core_name(call.op)
    groups = LINEAR.get(core, {}).get(call.op._overloadname, [])
    partials = ALL_PARTIALS if core in VALUE_PRESERVING else LINEAR_PARTIALS
    if not all(_is_float(t.dtype) for t in call.inputs) or not all(
            o is None or _is_float(o.dtype) for o in call.outputs):
        groups = []
    in_place = bool(call.op._schema.arguments[0].alias_info is not None
                    and call.op._schema.arguments[0].alias_info.is_write)
    nbytes = [max(1, t.dtype.itemsize) * t.numel() for t in call.inputs]
    strategies = [replicate]
    for m in range(specs[0].mesh.ndim):
        ins = [R] * n_in
        outs = [R] * n_out
        for k in range(length):
            members = [(pos, idx[k]) for pos, idx in lists]
            chosen, out = _element_choice(call, members, m, specs, nbytes, groups, partials, in_place)
            for (_, i), p in zip(members, chosen):
                ins[i] = p
            if n_out:
                outs[k] = out
        s = Strategy(tuple(ins), tuple(outs))
        if s not in strategies:
            strategies.append(s)
    return strategies


def _element_choice(call, members, m, specs, nbytes, groups, partials, in_place):
    """The placements of list position ``k`` (``members``: (schema position, flat index) per list)
    on mesh dim ``m``, and the output's: the cheapest candidate, ties to the first list's own."""
    current = [specs[i].placements[m] for _, i in members]
    shapes = {tuple(call.inputs[i].shape) for _, i in members}
    candidates = []  # (placements per member, output placement)
    lead = current[0]
    for p in [lead] + current[1:]:
        if isinstance(p, Shard) and len(shapes) == 1:
            candidates.append(((p,) * len(members), p))
    for group in groups:
        for p in partials:
            if lead == p or any(c == p for c in current):
                candidates.append((tuple(p if pos in group else R for pos, _ in members), p))
    candidates.append(((R,) * len(members), R))
    if in_place:
        # the result is written to the first list: its placement is the output's; it keeps its
        # own placement where a candidate allows it (no rebinding)
        candidates = [c for c in candidates if c[0][0] == c[1]]
        keeping = [c for c in candidates if c[0][0] == lead]
        candidates = keeping or candidates
    best, best_cost = None, None
    for cand in candidates:
        cost = sum(redistribute_cost(src, dst, nbytes[i]) for src, dst, (_, i) in zip(current, cand[0], members))
        if best_cost is None or cost < best_cost:
            best, best_cost = cand, cost
    return best


def _is_float(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def foreach_ops():
    """Every elementwise ``_foreach_*`` overload (functional and in place, not ``out=``)."""
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name
        if not name.startswith("aten::_foreach_") or "out" in schema.overload_name:
            continue
        op = getattr(getattr(aten, name[6:]), schema.overload_name or "default")
        if is_elementwise(op):
            yield op


def register(registry) -> None:
    for op in foreach_ops():
        # Shard only where every list's element has one shape: local shapes agree by construction
        registry.add(op, Rule(foreach_strategies, check_local=False), replace=True)

