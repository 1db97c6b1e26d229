"""The dispatcher: cache -> plan -> instructions.

:func:`dispatch` is what ``DTensor.__torch_dispatch__`` calls (installed once at import, see
``dtorch_core/__init__``). The cache key is the op plus the input specs and static arguments;
a hit runs the stored plan (emit redistributions, one ``Call``, wrap fresh handles) without
touching meta tensors or rules. A float that is one of the op's values (planner/numbers.py) is
keyed by its type only and travels with each Call. The cache is bounded (planner/cache.py). The
session comes from the inputs' handles: a handle belongs to the session that made it.
"""

from __future__ import annotations

import torch

from ..errors import OpError, SessionError
from ..tensor import DTensor
from .cache import remember
from .choose import common_mesh, plan_direct
from .fallback import fallback_plan, run_on_controller
from .numbers import NUMBER_KEY, number_positions, rule_reads_no_values
from .plans import FunctionPlan

aten = torch.ops.aten
# ops that read values on the host in torch too; they run on the controller with the full values
# (``_linalg_check_errors`` raises torch's LinAlgError: run on the workers its error had nowhere
# to go, as the op has no output)
_SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
             aten._linalg_check_errors.default}


# op -> (the op registry, FunctionPlan) of decompositions that serve every call and keep no plan
# per key (torch.optim's foreach ops, whose numbers change every step): such a call is handed to
# its decomposition before a key is built over every list element (run_foreach keys it itself)
_unkeyed: dict = {}


def dispatch(func, args, kwargs):
    hit = _unkeyed.get(func)
    if hit is not None and args and type(args[0]) in (list, tuple) and args[0] and type(args[0][0]) is DTensor:
        session = args[0][0]._handle.session
        if session.ops is hit[0] and not session.closed:
            return hit[1].run(session, args, kwargs, None)
    inputs: list = []
    positions = number_positions(func)
    numbers: tuple = ()
    if positions is not None:
        key, numbers = _numbered_key(func, args, kwargs, inputs, positions)
    else:
        key = _key(func, args, kwargs, inputs)
    return _run_keyed(func, args, kwargs, inputs, key, numbers)


def _run_keyed(func, args, kwargs, inputs, key, numbers: tuple):
    """Run the cached plan of ``key`` (planned and cached on a miss)."""
    # the first input's session; the plan checks that every other input has the same one
    # (DirectPlan.run), so the hot path reads each handle once
    first = inputs[0] if inputs else None
    session = first._handle.session if type(first) is DTensor else session_of(func, inputs)
    if session.closed:
        session_of(func, inputs)  # raises, naming the reason
    plan = session.plans.get(key)
    if plan is None:
        plan = build_plan(session, func, args, kwargs, inputs, numbers)
        if type(plan) is not FunctionPlan or plan.cached:
            remember(session, key, plan)
        elif _serves_every_call(session, func, plan):
            _unkeyed[func] = (session.ops, plan)
    return plan.run(session, args, kwargs, inputs)


def _key(func, args, kwargs, inputs) -> tuple:
    """The cache key with every static argument by value."""
    if kwargs:
        return (func, _key_of(args, inputs), _key_of(tuple(kwargs.values()), inputs), tuple(kwargs))
    return (func, _key_of_args(args, inputs))


def _numbered_key(func, args, kwargs, inputs, positions) -> tuple:
    """The cache key with each float at one of ``positions`` (number_positions) keyed as
    NUMBER_KEY, and where those floats are: their argument indices, then their keywords."""
    indices, names = positions
    key = []
    at = []
    for i, x in enumerate(args):
        t = type(x)
        if t is DTensor:  # inline, as in _key_of_args: the common case without a call
            inputs.append(x)
            key.append(x._spec)
        elif t is float and i in indices:
            key.append(NUMBER_KEY)
            at.append(i)
        else:
            key.append(_key_of(x, inputs))
    if not kwargs:
        return (func, tuple(key)), tuple(at)
    values = []
    for name, x in kwargs.items():
        if type(x) is float and name in names:
            values.append(NUMBER_KEY)
            at.append(name)
        else:
            values.append(_key_of(x, inputs))
    return (func, tuple(key), tuple(values), tuple(kwargs)), tuple(at)


def _by_value(func):
    """The entry of a numbered key whose op's rule may read its numbers after all: each call
    runs the plan of its key with the values (as an op without numbered positions)."""

    def run(*args, **kwargs):
        inputs: list = []
        return _run_keyed(func, args, kwargs, inputs, _key(func, args, kwargs, inputs), ())

    return FunctionPlan(run)


def dispatch_direct(func, args, kwargs):
    """Plan ``func`` with its rule, skipping its decomposition (for use inside decompositions)."""
    inputs: list = []
    key = ("direct", func, _key_of(args, inputs), _key_of(tuple(kwargs.values()), inputs), tuple(kwargs))
    session = session_of(func, inputs)
    plan = session.plans.get(key)
    if plan is None:
        mesh, view = common_mesh(func, inputs)
        rule = session.ops.rule_for(func)
        plan = None if rule is None else plan_direct(session, func, args, kwargs, inputs, rule, mesh, view)
        if plan is None:
            plan = fallback_plan(session, func)
        remember(session, key, plan)
    return plan.run(session, args, kwargs, inputs)


def _key_of_args(args: tuple, inputs: list) -> tuple:
    """``_key_of(args, inputs)`` with the common elements (DTensors, numbers) inline: one Python
    call per op instead of one per argument."""
    key = []
    for x in args:
        t = type(x)
        if t is DTensor:
            inputs.append(x)
            key.append(x._spec)
        elif t is float or t is int or t is bool:
            key.append((t, x))
        else:
            key.append(_key_of(x, inputs))
    return tuple(key)


def _key_of(x, inputs):
    t = type(x)
    if t is DTensor:
        inputs.append(x)
        return x._spec
    if t is tuple or t is list:
        return tuple([_key_of(a, inputs) for a in x])
    if t is float or t is int or t is bool:
        return (t, x)
    if isinstance(x, torch.Tensor):
        inputs.append(x)
        return ("plain", tuple(x.shape), x.dtype)
    return x


def session_of(func, inputs):
    """The session of the DTensor inputs; raises if they come from different or ended sessions."""
    session = None
    for x in inputs:
        if type(x) is DTensor:
            s = x._handle.session
            if s is not session:
                if session is not None:
                    raise SessionError(f"{func}: its inputs come from different dtorch sessions; a tensor "
                                       "belongs to the session that made it (dt.init starts a new one)")
                session = s
    if session is None:
        raise OpError(f"{func}: none of its inputs is a DTensor dtorch can find (tensors inside dicts are not "
                      "looked at)")
    if session.closed:
        raise SessionError(f"{func}: an input belongs to a dtorch session that has ended (dt.shutdown or a "
                           "new dt.init); its data is gone. Recreate the tensor in the current session")
    return session


def build_plan(session, func, args, kwargs, inputs, numbers: tuple = ()):
    """The plan of this call; ``numbers``: the positions of the floats its key holds by type only
    (its Calls bring them)."""
    if func in _SYNC_OPS:
        return FunctionPlan(lambda *a, **kw: run_on_controller(func, a, kw))
    decomposition = session.ops.decomposition_for(func)
    if decomposition is not None and _decomposes(decomposition, args, kwargs):
        # the ops it calls check their own meshes (a foreach list may span several)
        return FunctionPlan(decomposition, getattr(decomposition, "cache_plan", True))
    mesh, view = common_mesh(func, inputs)
    rule = session.ops.rule_for(func)
    if rule is None:
        return fallback_plan(session, func)
    if numbers and not rule_reads_no_values(rule):
        return _by_value(func)
    plan = plan_direct(session, func, args, kwargs, inputs, rule, mesh, view, numbers=numbers)
    if plan is None:
        return fallback_plan(session, func, "has a sharding rule, but none of its choices fits these inputs")
    return plan


def _serves_every_call(session, func, plan) -> bool:
    decomposition = session.ops.decomposition_for(func)
    return plan.fn is decomposition and getattr(decomposition, "applies", None) is None


def _decomposes(decomposition, args, kwargs) -> bool:
    """A decomposition with an ``applies(args, kwargs)`` predicate serves only the calls it
    accepts, decided once per cache key (e.g. indexing by boolean masks, whose dtype is in the
    key); the other calls are planned with the op's rule, as if it had no decomposition."""
    applies = getattr(decomposition, "applies", None)
    return applies is None or applies(args, kwargs)
