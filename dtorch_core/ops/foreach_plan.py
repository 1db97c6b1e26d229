"""One planned call for a whole foreach list, kept across calls whose numbers change.

torch.optim passes numbers that change every step (Adam's ``step_size`` list, a scheduled
learning rate). A plan keyed by them would be planned again on every step, and planning a call
over hundreds of tensors costs milliseconds (meta tensors of every element). The foreach rule
does not look at the numbers (only at their types, which stay in the key), so the plan is kept
under a key without them: when they change, only a new worker-side definition is sent (the same
target, placements and redistributions, the new numbers in its arguments).
"""

from __future__ import annotations

import attrs
import torch

from ..ir.instructions import Slot
from ..planner.choose import common_mesh, plan_direct
from ..planner.trees import substitute
from ..tensor import DTensor

_NUMBERS = (int, float, bool, complex)
NOT_PLANNED = object()  # what run_foreach returns when none of the rule's choices fits


@attrs.define
class ForeachPlan:
    """The plan of one key and the numbers its worker definition holds now."""

    plan: object  # DirectPlan
    define: object  # its DefinePlan
    numbers: tuple  # repr of every number argument, in argument order
    pure: bool


def run_foreach(session, op, args, kwargs, rule):
    """Run ``op`` as one planned call with ``rule``; NOT_PLANNED if none of its choices fits."""
    inputs: list = []
    numbers: list = []
    key = ("foreach", op, _key(tuple(args), inputs, numbers), _key(tuple(kwargs.values()), inputs, numbers),
           tuple(kwargs))
    numbers = tuple(numbers)
    entry = session.plans.get(key)
    if entry is None:
        mesh, view = common_mesh(op, inputs)
        plan = plan_direct(session, op, args, kwargs, inputs, rule, mesh, view)
        if plan is None:
            return NOT_PLANNED
        entry = session.plans[key] = ForeachPlan(plan, session.plan_names[plan.plan_id], numbers,
                                                 plan.plan_id in session.pure_plans)
    elif numbers != entry.numbers:
        # the rule reads no numbers and has no per-rank arguments: the worker definition is the
        # old one with the new arguments (tensors as slots, as the planner writes them)
        t_args, t_kwargs = substitute(args, kwargs, Slot)
        define = attrs.evolve(entry.define, plan_id=session.new_plan_id(), args=t_args, kwargs=t_kwargs)
        session.define_plan(define, pure=entry.pure)
        entry.plan = attrs.evolve(entry.plan, plan_id=define.plan_id)
        entry.define, entry.numbers = define, numbers
    return entry.plan.run(session, args, kwargs, inputs)


def _key(x, inputs: list, numbers: list):
    t = type(x)
    if t is DTensor:
        inputs.append(x)
        return x._spec
    if t is tuple or t is list:
        return tuple([_key(a, inputs, numbers) for a in x])
    if t in _NUMBERS:
        numbers.append(repr(x))  # exact for floats (-0.0 and 0.0 differ)
        return t
    if isinstance(x, torch.Tensor):
        inputs.append(x)
        return ("plain", tuple(x.shape), x.dtype)
    return x
