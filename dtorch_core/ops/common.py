"""Building blocks for placement signatures."""

from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from ..planner.schema import Strategy

R = Replicate()
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))


def replicate_all(call) -> Strategy:
    return Strategy((R,) * len(call.inputs), (R,) * len(call.outputs))


def dim_map_strategies(call, in_to_out: dict, *, partials=LINEAR_PARTIALS, extra_inputs=None):
    """Input 0 dims map to output dims (``in_to_out``: input dim -> output dim for every output).

    Other tensor inputs must be Replicate unless ``extra_inputs(d)`` gives their placements for
    a shard of input dim ``d``. Partial placements in ``partials`` pass straight through.
    """
    n_in = len(call.inputs)
    out = [replicate_all(call)]
    for d, od in in_to_out.items():
        if od is None:
            continue
        rest = extra_inputs(d) if extra_inputs else (R,) * (n_in - 1)
        if rest is None:
            continue
        outs = tuple(R if o is None else Shard(od) for o in call.outputs)
        out.append(Strategy((Shard(d),) + tuple(rest), outs))
    for p in partials:
        outs = tuple(R if o is None else p for o in call.outputs)
        out.append(Strategy((p,) + (R,) * (n_in - 1), outs))
    return out


def pointwise_strategies(call, linear=(), skip_dims=(), partial_ops=LINEAR_PARTIALS):
    """Elementwise ops with broadcasting.

    ``linear``: a list of input-index sets; for each set, the op is linear in those inputs taken
    together (e.g. ``[{0, 1}]`` for add, ``[{0}, {1}]`` for mul), so Partial inputs in the set
    (with every other input Replicate) give a Partial output. ``skip_dims``: output dims that
    must not be sharded (e.g. the softmax dim).
    """
    ref = next((o for o in call.outputs if o is not None), None)
    n_in = len(call.inputs)
    if ref is None:
        return [replicate_all(call)]
    nd = ref.ndim
    shape = tuple(ref.shape)
    skip = {d % nd for d in skip_dims} if nd else set()
    strategies = [replicate_all(call)]
    same_outputs = all(o is None or tuple(o.shape) == shape for o in call.outputs)
    if same_outputs:
        for d in range(nd):
            if d in skip:
                continue
            ins = []
            for t in call.inputs:
                td = d - (nd - t.ndim)
                ins.append(Shard(td) if td >= 0 and t.shape[td] == shape[d] and t.ndim <= nd else R)
            if all(p == R for p in ins):
                continue
            strategies.append(Strategy(tuple(ins), tuple(R if o is None else Shard(d) for o in call.outputs)))
    for group in linear:
        if not all(i < n_in for i in group):
            continue
        for p in partial_ops:
            ins = tuple(p if i in group else R for i in range(n_in))
            strategies.append(Strategy(ins, tuple(R if o is None else p for o in call.outputs)))
    return strategies


def add_all(registry, packet, rule, **kw) -> None:
    """Register ``rule`` for every overload of ``packet`` (replacing earlier rules)."""
    for name in packet.overloads():
        registry.add(getattr(packet, name), rule, replace=True, **kw)


def planned_directly_when(decomposition, direct):
    """``decomposition`` with an ``applies`` predicate (planner/dispatch.py's ``_decomposes``): a
    call for which ``direct(*args, **kwargs)`` holds is planned with the op's own rule, decided
    once per plan-cache key, and never reaches the decomposition; so those calls hit the plan
    cache (and the native hot path) instead of running Python on every call. ``direct`` may read
    only what the key holds: the input specs and the static arguments."""
    decomposition.applies = lambda args, kwargs: not direct(*args, **kwargs)
    return decomposition
