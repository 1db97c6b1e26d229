"""One planned call for a whole foreach list, kept across calls whose numbers change.

torch.optim passes floats that change every step (Adam's ``step_size`` list, a scheduled
learning rate). A plan keyed by them would be planned again on every step, and planning a call
over hundreds of tensors costs milliseconds (meta tensors of every element). The foreach rules
do not read the numbers (only their types, which stay in the key), so a float is keyed by its
type and its worker definition holds a ``Number`` placeholder there, inside lists too: each
``Call`` brings the floats of that call (``Call.numbers``, planner/numbers.py), and a step sends
no new definition. Ints, bools and complex numbers keep their values in the key, as the
dispatcher keys them (they do not change from step to step in torch.optim).
"""

from __future__ import annotations

import attrs
import torch

from ..ir.instructions import Number
from ..planner.cache import remember
from ..planner.choose import common_mesh, plan_direct
from ..planner.gathers import GatheringPlan
from ..planner.numbers import rule_reads_no_values
from ..tensor import DTensor

_BY_VALUE = (int, bool, complex)
NOT_PLANNED = object()  # what run_foreach returns when none of the rule's choices fits


def run_foreach(session, op, args, kwargs, rule):
    """Run ``op`` as one planned call with ``rule``; NOT_PLANNED if none of its choices fits."""
    inputs: list = []
    numbers: list = []
    key = ("foreach", op, _key(tuple(args), inputs, numbers), _key(tuple(kwargs.values()), inputs, numbers),
           tuple(kwargs))
    plan = session.plans.get(key)
    if plan is None:
        if numbers and not rule_reads_no_values(rule):
            # a rule that rewrites arguments per rank may move or read a number: by value
            key = (key, tuple(map(repr, numbers)))  # repr: -0.0 and 0.0 differ
            plan = session.plans.get(key)
        if plan is None:
            plan = _plan(session, op, args, kwargs, inputs, rule, numbers)
            if plan is None:
                return NOT_PLANNED
            remember(session, key, plan)
    # DirectPlan.run takes the Call's numbers from ``args`` at the plan's ``number_at``: here
    # positions 0..n-1 of the flat numbers (the plan reads nothing else from its args)
    return plan.run(session, numbers, {}, inputs)


def _plan(session, op, args, kwargs, inputs, rule, numbers):
    mesh, view = common_mesh(op, inputs)
    plan = plan_direct(session, op, args, kwargs, inputs, rule, mesh, view)
    if plan is None or not numbers:
        return plan
    direct = plan.plan if type(plan) is GatheringPlan else plan
    if rule_reads_no_values(rule):
        # send the definition again under its id with a Number at each float (the workers run
        # the stream in order: the first Call finds this one); the rule wrote the call's own
        # arguments, tensors as slots, the same on every rank
        define = session.plan_names[direct.plan_id]
        counter = iter(range(len(numbers)))
        define = attrs.evolve(define, args=_numbered(define.args, counter),
                              kwargs={k: _numbered(v, counter) for k, v in define.kwargs.items()})
        session.define_plan(define, pure=direct.plan_id in session.pure_plans)
        direct.number_at = tuple(range(len(numbers)))
    return plan


def _numbered(x, counter):
    """``x`` with each float replaced by the next ``Number`` (in the order ``_key`` met them)."""
    t = type(x)
    if t is float:
        return Number(next(counter))
    if t is tuple or t is list:
        return t(_numbered(a, counter) for a in x)
    return x


def _key(x, inputs: list, numbers: list):
    t = type(x)
    if t is DTensor:
        inputs.append(x)
        return x._spec
    if t is tuple or t is list:
        key = []
        for a in x:  # the elements of torch.optim's lists: DTensors and floats, inline
            ta = type(a)
            if ta is DTensor:
                inputs.append(a)
                key.append(a._spec)
            elif ta is float:
                numbers.append(a)
                key.append(float)
            else:
                key.append(_key(a, inputs, numbers))
        return tuple(key)
    if t is float:
        numbers.append(x)
        return float
    if t in _BY_VALUE:
        return (t, x)  # 1, 1.0 and True are equal keys otherwise
    if isinstance(x, torch.Tensor):
        inputs.append(x)
        return ("plain", tuple(x.shape), x.dtype)
    return x
