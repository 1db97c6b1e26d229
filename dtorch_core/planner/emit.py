"""Issuing redistributions: the Collectives of a redistribution plan, and what they tell.

Between worker processes a collective's members must agree on every contribution's size before
the payloads move. The controller knows them all (the spec fixes every rank's local shape), so
runners that ask for it (``Runner.collective_hints``) get each rank's local source shape in the
instruction; see comm/dist.py for how they are used. Every runner gets the dtype: a rank whose
source failed must still group a merged all-reduce's sources by dtype as its peers do.

Every collective that moves data is also reported to the session's comm counters
(``dt.debug.comm_mode``) as a :class:`CommEvent`.

A step whose source dies with it is marked ``consume``, so workers may build its result in the
source's buffer (an all-reduce in place) instead of a copy (they check that nothing of their own
shares that memory: a view, an alias). Two cases: every step after the first of a plan, whose
source is the previous step's fresh result that nothing else names; and a step whose source's
handle the controller frees before the step leaves, with nothing after it in the batch reading
the source (:func:`mark_consumed`, at the session's flush: only then is it known, e.g. the
Partial output of an op that is redistributed at once and dropped).
"""

from __future__ import annotations

import math

import attrs

from ..ir.instructions import (
    COMMUNICATING_KINDS,
    Call,
    Collective,
    Constant,
    DefineMesh,
    DefinePlan,
    DefineProgram,
    Delete,
    DropProgram,
    Fetch,
    MergedAllReduce,
    Put,
    RunProgram,
    Stats,
    merge_hints,
)
from ..spec import local_shapes


@attrs.frozen
class CommEvent:
    """One collective issued: its kind, the op that needed it, the global bytes of its tensor."""

    kind: str  # all_gather, all_reduce, reduce_scatter, all_to_all, shift
    op: str  # the op (or "redistribute", "full_tensor", ...) the collective was issued for
    nbytes: int  # global size of the tensor the collective works on
    # placements before and after it, and its mesh dim (dt.explain shows them; () / -1: not known)
    src: tuple = ()
    dst: tuple = ()
    mesh_dim: int = -1


def note_comm(session, event: CommEvent) -> None:
    """Report ``event`` to the session's comm counters (and to a running recording)."""
    for counter in session.comm_counters:
        counter.record(event)


# kinds whose result is a tensor of its own on every worker (alias and to_partial may hand the
# source itself on)
_FRESH_KINDS = COMMUNICATING_KINDS | {"local_chunk"}


def emit_steps(session, mesh_id: int, tid: int, steps, spec, op_name: str = "") -> list:
    """Emit the Collectives of redistribution ``steps`` from tensor ``tid`` (of ``spec``, or
    None for a replicated plain tensor); the ids made, the last one holding the result. Every id
    made but the last must be freed by the caller, unused."""
    made = []
    placements = spec.placements if spec is not None else None
    consume = False
    if steps and steps[0].kind in COMMUNICATING_KINDS:
        session.consumable += 1  # the source may be freed before the flush (mark_consumed)
    for step in steps:
        new = session.new_tid()
        shapes, dtype = (), None
        if spec is not None and step.kind in COMMUNICATING_KINDS:
            dtype = spec.dtype
            if session.collective_hints:
                shapes = local_shapes(spec.shape, placements, spec.mesh.shape)
            if session.comm_counters:
                note_comm(session, CommEvent(step.kind, op_name, math.prod(spec.shape) * spec.dtype.itemsize,
                                             placements, step.placements, step.mesh_dim))
        session.emit(Collective(step.kind, mesh_id, step.mesh_dim, tid, new, step.dim, step.reduce_op, step.dim2,
                                shapes, dtype, consume=consume))
        made.append(new)
        tid = new
        placements = step.placements
        consume = step.kind in _FRESH_KINDS
    return made


# what reads no tensor id of an earlier instruction (mark_consumed); Constant only in programs
_READS_NOTHING = frozenset({DefineMesh, DefinePlan, Put, Constant, Delete, Stats, DefineProgram, DropProgram})


def mark_consumed(batch: list, freed) -> list:
    """``batch`` (about to leave, followed by the Delete of ``freed``) with ``consume`` set on
    every communicating Collective whose source is in ``freed`` and read by nothing after it."""
    dead = set(freed)
    read_later: set = set()
    for i in range(len(batch) - 1, -1, -1):
        ins = batch[i]
        t = type(ins)
        if t is Collective:
            src = ins.src
            if src in dead and src not in read_later and not ins.consume and ins.kind in COMMUNICATING_KINDS:
                batch[i] = attrs.evolve(ins, consume=True)
            read_later.add(src)
        elif t is Call:
            read_later.update(ins.inputs)
        elif t is MergedAllReduce:
            read_later.update(ins.srcs)
        elif t is Fetch:
            read_later.add(ins.tid)
        elif t is RunProgram:
            read_later.update(ins.inputs)
        elif t not in _READS_NOTHING:
            break  # an instruction this does not know: what it reads is unknown, mark nothing before it
    return batch


def emit_shift(session, mesh_id: int, tid: int, spec, mesh_dim: int, offset: int, op_name: str = "") -> int:
    """Emit a shift of tensor ``tid`` (of ``spec``) along ``mesh_dim``: each member of a group
    receives member ``index + offset``'s local tensor. The id made."""
    new = session.new_tid()
    shapes = local_shapes(spec.shape, spec.placements, spec.mesh.shape) if session.collective_hints else ()
    if session.comm_counters:
        note_comm(session, CommEvent("shift", op_name, math.prod(spec.shape) * spec.dtype.itemsize,
                                     spec.placements, spec.placements, mesh_dim))
    session.emit(Collective("shift", mesh_id, mesh_dim, tid, new, shapes=shapes, dtype=spec.dtype, offset=offset))
    return new


def merged_hints(session, specs) -> tuple[tuple, tuple]:
    """``(shapes, dtypes)`` of a MergedAllReduce of tensors of ``specs``: per rank the local shape
    of every source (empty where the runner needs none), and every source's dtype (always: a
    rank whose sources failed must still group them by dtype as its peers do)."""
    dtypes = [s.dtype for s in specs]
    if not session.collective_hints:
        return (), tuple(dtypes)
    return merge_hints([local_shapes(s.shape, s.placements, s.mesh.shape) for s in specs], dtypes)
