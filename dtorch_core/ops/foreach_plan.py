"""One planned call for a whole foreach list, kept across calls whose numbers change.

torch.optim passes numbers that change every step (Adam's ``step_size`` list, a scheduled
learning rate). A plan keyed by them would be planned again on every step, and planning a call
over hundreds of tensors costs milliseconds (meta tensors of every element). The foreach rule
does not look at the numbers (only at their types, which stay in the key), so the plan is kept
under a key without them: when they change, only a new worker-side definition is sent (the same
target, placements and redistributions, the new numbers in its arguments). A key keeps the
definitions of its most recent number sets, so a step's calls with fixed numbers send nothing
new, and the worker's plan table does not grow step after step.
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


# number variants whose worker definitions a key keeps: the calls of one optimizer step with
# fixed numbers (betas, eps) stay defined, and a number that changes every step (Adam's step
# sizes) takes over the definition of the least recently used variant instead of adding one
VARIANTS = 16


@attrs.define
class ForeachPlan:
    """The plan of one key and its worker definitions, one per set of numbers (most recent last)."""

    plan: object  # DirectPlan of the first numbers
    define: object  # its DefinePlan
    pure: bool
    variants: dict = attrs.field(factory=dict)  # numbers -> DirectPlan with its own plan id
    pinned: set = attrs.field(factory=set)  # plan ids a recording used: a program may call them

    def for_numbers(self, session, numbers: tuple, args, kwargs):
        plan = self.variants.pop(numbers, None)
        if plan is None:
            plan = self._define(session, args, kwargs)
        self.variants[numbers] = plan  # most recently used last
        if session.is_recording:
            self.pinned.add(plan.plan_id)
        return plan

    def _define(self, session, args, kwargs):
        # the rule reads no numbers and has no per-rank arguments: the worker definition is the
        # first one with the new arguments (tensors as slots, as the planner writes them). A
        # definition sent with an id that exists replaces it for the calls after it (workers
        # run the stream in order); ids a captured program may call are never replaced
        plan_id = None
        if len(self.variants) >= VARIANTS:
            for old, plan in self.variants.items():
                if plan.plan_id not in self.pinned:
                    plan_id = self.variants.pop(old).plan_id
                    break
        t_args, t_kwargs = substitute(args, kwargs, Slot)
        define = attrs.evolve(self.define, plan_id=plan_id if plan_id is not None else session.new_plan_id(),
                              args=t_args, kwargs=t_kwargs)
        session.define_plan(define, pure=self.pure)
        return attrs.evolve(self.plan, plan_id=define.plan_id)


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
        entry = session.plans[key] = ForeachPlan(plan, session.plan_names[plan.plan_id],
                                                 plan.plan_id in session.pure_plans)
        entry.variants[numbers] = plan
        if session.is_recording:
            entry.pinned.add(plan.plan_id)
        return plan.run(session, args, kwargs, inputs)
    return entry.for_numbers(session, numbers, args, kwargs).run(session, args, kwargs, inputs)


def _key(x, inputs: list, numbers: list):
    t = type(x)
    if t is DTensor:
        inputs.append(x)
        return x._spec
    if t is tuple or t is list:
        key = []
        for a in x:  # the elements of torch.optim's lists: DTensors, inline
            if type(a) is DTensor:
                inputs.append(a)
                key.append(a._spec)
            else:
                key.append(_key(a, inputs, numbers))
        return tuple(key)
    if t in _NUMBERS:
        numbers.append(repr(x))  # exact for floats (-0.0 and 0.0 differ)
        return t
    if isinstance(x, torch.Tensor):
        inputs.append(x)
        return ("plain", tuple(x.shape), x.dtype)
    return x
