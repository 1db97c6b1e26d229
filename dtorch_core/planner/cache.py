"""The bound on the plan cache (``session.plans``): beyond :data:`LIMIT` entries the oldest go.

Every entry that holds worker plans costs memory on every worker for as long as it is kept, and
a workload whose keys never repeat (shapes or numbers that change every call) would add entries
without end. :func:`remember` stores an entry and, past the limit, evicts the oldest quarter
(insertion order: a hit moves nothing, so the hot path pays nothing for the bound); a workload
whose working set fits keeps every entry, and an evicted entry that comes back is planned again.
The workers are told to forget the evicted plans (``DropPlans``, after every Call that names them
in the stream). An entry is kept when dropping it could leave a Call without its plan:

- while a capture records (its program will call the plans it records);
- plans a live captured program calls (``session.program_plans``);
- plan objects something else holds too (another cache, a decomposition's closure, a caller
  about to run it): only an entry whose plans nothing but the cache references goes.

Entries of other kinds than the planner's (an ops module's own plan objects) are never evicted:
their modules keep them bounded or reuse them.
"""

from __future__ import annotations

import sys
import weakref

from ..ir.instructions import DropPlans
from .gathers import GatheringPlan
from .plans import DirectPlan, FunctionPlan

LIMIT = 8192  # entries of session.plans


# session -> entries that stayed in the last eviction beyond its target (kept ones): the next one
# waits until as many more came, so a cache full of kept entries is not scanned on every insert
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(session, key, plan) -> None:
    """``session.plans[key] = plan``, evicting the oldest entries once there are more than LIMIT."""
    plans = session.plans
    plans[key] = plan
    # not while a capture runs, its unrecorded blocks included (``_recorders`` is set for the
    # whole capture): the program it makes will call the plans it recorded
    if len(plans) > LIMIT + _kept.get(session, 0) and session._recorders is None:
        target = LIMIT * 3 // 4
        evict(session, len(plans) - target)
        _kept[session] = max(0, len(plans) - target)


def evict(session, count: int) -> int:
    """Evict up to ``count`` of the oldest evictable entries; returns how many went."""
    plans = session.plans
    pinned = set().union(*session.program_plans.values()) if session.program_plans else set()
    only_cached = _only_cached()
    dropped: list = []
    gone = 0
    for key in list(plans):
        if gone >= count:
            break
        ids = _worker_plans(plans, key, only_cached)
        if ids is None or not pinned.isdisjoint(ids):
            continue
        del plans[key]
        dropped.extend(ids)
        gone += 1
    if dropped:
        for plan_id in dropped:
            session.plan_names.pop(plan_id, None)
            session.pure_plans.discard(plan_id)
        session.emit(DropPlans(tuple(dropped)))
    return gone


def clear(session) -> None:
    """Empty the cache (the plans depend on a setting that changed); the workers drop the plans
    that nothing else holds and no live program calls."""
    evict(session, len(session.plans))
    session.plans.clear()
    _kept.pop(session, None)


def _holders(x) -> int:
    return sys.getrefcount(x)


def _only_cached() -> int:
    """What :func:`_holders` says of an object that one container holds and nothing else.

    Measured, not a constant: after a torch.compile that dtorch refused, the interpreter holds
    one more reference to every call's argument (tests/test_redistribute_inplace.py's
    _calls_add_a_reference); a fixed count then called every entry held elsewhere and nothing
    was ever evicted."""
    probe = [object()]
    return _holders(probe[0])


def _worker_plans(plans, key, only_cached: int) -> tuple | None:
    """The worker plan ids ``plans[key]`` owns, or None where it must stay (see the module's notes)."""
    if _holders(plans[key]) > only_cached:
        return None
    entry = plans[key]
    t = type(entry)
    if t is FunctionPlan:
        return ()
    if t is DirectPlan:
        return (entry.plan_id,)
    if t is GatheringPlan:
        if type(entry.plan) is DirectPlan and _holders(entry.plan) <= only_cached:
            return (entry.plan.plan_id,)
    return None
