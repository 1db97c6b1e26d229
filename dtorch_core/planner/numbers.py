"""Python numbers that are an op's values, not its structure: one plan serves every value.

User code passes numbers that change from call to call (``x * scale`` with a scale computed per
step, ``torch.clamp(x, max=t)``, a schedule). Keyed by value, each call would plan the op again,
define a new plan on every worker and keep both for the life of the session. For the ops listed
here a float at one of :func:`number_positions`'s arguments is keyed by its type only
(:data:`NUMBER_KEY`), the plan's worker definition holds a ``Number`` placeholder there, and each
``Call`` brings the value (``Call.numbers``); the native hot path (native/fastpath.cpp) asks this
module for the positions once per op and builds the same key.

An op qualifies when its rule cannot read the value: the elementwise ops (torch's ``pointwise``
tag, whose rule looks at dtypes and linearity only; not ``masked_fill``, whose rule reads a zero
fill) and the fills below; and only at arguments typed ``Tensor`` or ``Scalar`` in its schema (a
``float`` argument may be structural, as upsample's scale factors are). Ints and bools keep their
values in the key, as before: the numbers that change per step in practice (scales, schedules,
clamps, learning rates) are floats, and an int that changes every call is still planned per
value (the cache's bound, planner/cache.py, keeps that from growing without end).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# what a number at a value position contributes to the key (its value goes to the Call)
NUMBER_KEY = ("number", float)

# fills whose rules read no value (ops/pointwise.py's fill_rule and like_rule)
_FILLS = frozenset({aten.fill_.Scalar, aten.fill.Scalar, aten.full_like.default})
# elementwise ops whose rule reads the value (ops/pointwise.py's _call_groups)
_READ_BY_RULE = frozenset({aten.masked_fill, aten.masked_fill_})
_VALUE_TYPES = frozenset({"Tensor", "number", "Optional[Tensor]", "Optional[number]"})

_positions: dict = {}  # op -> (positional indices, keyword names) or None


def number_positions(func):
    """``(indices, names)``: the positional indices and keyword-only names of ``func``'s
    arguments at which a float is a plain value, or None when there are none (keyed by value)."""
    try:
        return _positions[func]
    except KeyError:
        pass
    found = _positions[func] = _find(func)
    return found


def _find(func):
    if not isinstance(func, torch._ops.OpOverload):
        return None
    tags = func.tags
    if func not in _FILLS and (torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags
                               or func.overloadpacket in _READ_BY_RULE):
        return None
    indices, names = [], []
    for i, arg in enumerate(func._schema.arguments):
        if str(arg.type) in _VALUE_TYPES:
            (names.append(arg.name) if arg.kwarg_only else indices.append(i))
    if not indices and not names:
        return None
    return frozenset(indices), frozenset(names)


def rule_reads_no_values(rule) -> bool:
    """Whether a plan of ``rule`` can take its numbers per call: its worker arguments are the
    op's own (no per-rank rewrite that might move or change a number, no kernel of its own)."""
    return rule is not None and rule.localize is None and rule.kernel is None
