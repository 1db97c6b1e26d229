"""Ops with no usable sharding rule: run replicated (gathered inputs), or on the controller."""

from __future__ import annotations

import warnings

import torch

from ..errors import FallbackRefusedError
from ..placement import Replicate
from ..tensor import DTensor
from ..worker.kernels import SEEDED_PREFIX
from .choose import common_mesh, mutated_inputs, plan_direct
from .moves import fetch_full, issue_redistribute
from .plans import FunctionPlan
from .schema import Rule
from .source import user_source
from .trees import map_structure, substitute

aten = torch.ops.aten


def fallback_plan(session, func, reason: str = "has no sharding rule") -> FunctionPlan:
    """The plan of an op the rules cannot shard; raises in strict mode."""
    if session.strict:
        raise FallbackRefusedError(
            f"{func} {reason} and strict mode is on; register a rule "
            "(dtorch_register_ops) or turn strict mode off"
        )
    return FunctionPlan(lambda *args, **kwargs: replicated_fallback(session, func, args, kwargs))


def warn_fallback(name: str) -> None:
    """Warn that ``name`` runs replicated, pointing at the user's line (called once per op and
    session: ``session.count_fallback`` says when)."""
    message = (f"dtorch: {name} has no sharding rule; it runs replicated (inputs gathered). "
               "See dt.fallback_counts(); strict mode raises instead.")
    source = user_source(2)
    if source is None:
        warnings.warn(message, stacklevel=2)
    else:
        warnings.warn_explicit(message, UserWarning, source[0], source[1])


def replicated_fallback(session, func, args, kwargs):
    """Gather every input to Replicate, run the op on each rank, write mutated inputs back."""
    name = str(func)
    if session.count_fallback(name):
        warn_fallback(name)
    inputs = _flat_inputs(args, kwargs)
    mesh, view = common_mesh(func, inputs)
    replicated = {}
    for x in inputs:
        if type(x) is DTensor and id(x) not in replicated:
            replicated[id(x)] = issue_redistribute(x, (Replicate(),) * mesh.ndim, op_name=name)
    r_args, r_kwargs = substitute(args, kwargs, lambda i: replicated.get(id(inputs[i]), inputs[i]))
    rep_inputs = [replicated.get(id(x), x) for x in inputs]
    rule = Rule(lambda call: [], kernel=SEEDED_PREFIX + func.name() if _is_random(func) else None)
    plan = plan_direct(session, func, r_args, r_kwargs, rep_inputs, rule, mesh, view, force_replicate=True)
    out = plan.run(session, r_args, r_kwargs, rep_inputs)
    gathered = any(type(x) is DTensor and not x._spec.is_replicated() for x in inputs)
    if gathered and any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        # a view of a gathered copy: a write through it would miss the tensor it claims to view,
        # so mark it as such (DirectPlan refuses in-place writes to it)
        map_structure(out, lambda t: setattr(t, "_view_state", 2) if type(t) is DTensor else None)
    mutated, _ = mutated_inputs(func, args, kwargs)
    written = {}
    for i in sorted(mutated):
        x = inputs[i]
        if type(x) is DTensor and id(x) not in written:
            written[id(x)] = x
            with torch.no_grad():
                aten.copy_.default(x, replicated[id(x)])
    if written:
        out = map_structure(out, lambda t: written.get(id(_rep_source(t, replicated, inputs)), t))
    return out


def _flat_inputs(args, kwargs) -> list:
    """Every tensor argument, in the order substitute() numbers them: args, then kwargs' values."""
    out: list = []
    map_structure((tuple(args), tuple(kwargs.values())), out.append)
    return out


def _rep_source(t, replicated, inputs):
    for x in inputs:
        if replicated.get(id(x)) is t:
            return x
    return t


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def run_on_controller(func, args, kwargs):
    """Run ``func`` on the controller with every DTensor argument's full value."""
    inputs = _flat_inputs(args, kwargs)
    fulls = [fetch_full(v) if type(v) is DTensor else v for v in inputs]
    plain_args, plain_kwargs = substitute(args, kwargs, lambda i: fulls[i])
    return func(*plain_args, **plain_kwargs)
