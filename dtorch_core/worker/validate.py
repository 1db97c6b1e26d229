"""Checking instructions against the worker's state before they run.

A batch that decodes (ir/wire checks types and sizes) may still be wrong for this worker: a mesh
dim that does not exist, a Put of something that is not a tensor, a mesh of ranks outside the
world. Such an instruction comes from a bug in the controller or a plugin (or a peer that is not
the controller); it must not kill the worker. :func:`problem` names what is wrong with one of
the instruction types that would otherwise fail half-way or talk to peers (checked before they
run, identically on every rank, so collectives stay in step); :func:`describe` turns an error
that another instruction raised while running into the same kind of message. The worker then
skips the instruction, marks its outputs failed (reads of them raise with the message) and
reports it to the controller with a ``Reply(PROTOCOL, rank, error=...)``, which the process
runner raises at the next read (``WorkerError: worker rank r rejected a batch: ...``).
"""

from __future__ import annotations

import math

import torch

from ..ir.instructions import (
    Call,
    Collective,
    Constant,
    DefineMesh,
    DefinePlan,
    DefineProgram,
    MergedAllReduce,
    Put,
    RunProgram,
)
from ..ir.wire.codes import _INSTRUCTION_TYPES

#: Request id of a worker's report that it rejected a frame or an instruction (the process
#: runner's ``PROTOCOL``: runners/process.py collects these replies and raises them at reads).
PROTOCOL = 0

#: Errors an invalid instruction raises while it runs (bad ids, indices, types). Anything else
#: (a communicator's RuntimeError, a timeout) keeps its old meaning for the runner.
INVALID = (IndexError, KeyError, TypeError, ValueError, AttributeError, OverflowError)

_WHAT_TO_DO = (
    "; the instruction was skipped (its outputs fail) and the worker keeps serving. The controller "
    "or a plugin built an invalid instruction: report it with the op that issued it"
)


def world_size(worker) -> int | None:
    """The number of ranks, when this worker knows it."""
    n = getattr(worker, "world_size", None)
    if n is None:
        n = getattr(worker.exchange, "world_size", None)
    if n is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        n = torch.distributed.get_world_size()
    return n if type(n) is int else None


def _is_int(x) -> bool:
    return type(x) is int


def _mesh_problem(worker, mesh_id, mesh_dim=None) -> str | None:
    if mesh_id not in worker.meshes:
        return f"mesh {mesh_id!r} is not defined on this worker (no DefineMesh for it came first)"
    view = worker.meshes[mesh_id]
    if view is None or mesh_dim is None:  # not a member of the mesh: the instruction is not for us
        return None
    ndim = len(view.groups)
    if not _is_int(mesh_dim) or not 0 <= mesh_dim < ndim:
        return f"mesh dim {mesh_dim!r} does not exist: mesh {mesh_id} has {ndim} dim{'s' if ndim != 1 else ''}"
    return None


def _define_mesh(worker, ins: DefineMesh) -> str | None:
    shape, ranks = ins.shape, ins.ranks
    if not shape or not all(_is_int(d) and d > 0 for d in shape):
        return f"mesh {ins.mesh_id} has shape {shape!r}; a mesh's shape is one or more positive ints"
    if not all(_is_int(r) for r in ranks):
        return f"mesh {ins.mesh_id} has ranks {ranks!r}; ranks are ints"
    if math.prod(shape) != len(ranks):
        return f"mesh {ins.mesh_id} of shape {tuple(shape)} needs {math.prod(shape)} ranks, got {len(ranks)}"
    if len(set(ranks)) != len(ranks):
        return f"mesh {ins.mesh_id} names a rank twice: {tuple(ranks)}"
    n = world_size(worker)
    bad = [r for r in ranks if r < 0 or (n is not None and r >= n)]
    if bad:
        where = f"0..{n - 1}" if n is not None else "0 and up"
        return f"mesh {ins.mesh_id} has ranks {bad} outside the world (ranks {where})"
    return None


def _define_plan(worker, ins: DefinePlan) -> str | None:
    bad = _mesh_problem(worker, ins.mesh_id)
    if bad:
        return bad
    if ins.rank_args and worker.rank in ins.rank_args:
        mine = ins.rank_args[worker.rank]
        if type(mine) not in (tuple, list) or len(mine) != 2 or type(mine[0]) not in (tuple, list) \
                or type(mine[1]) is not dict:
            return f"plan {ins.plan_id}: rank_args[{worker.rank}] is not an (args tuple, kwargs dict) pair"
    return None


def _put(worker, ins: Put) -> str | None:
    shard = ins.shards.get(worker.rank)
    if shard is not None and not isinstance(shard, torch.Tensor):
        return f"Put of tensor {ins.tid}: the shard for rank {worker.rank} is a {type(shard).__name__}, not a tensor"
    return None


def _collective(worker, ins: Collective) -> str | None:
    bad = _mesh_problem(worker, ins.mesh_id, ins.mesh_dim)
    if bad:
        return f"Collective {ins.kind!r}: {bad}"
    return None


def _merged(worker, ins: MergedAllReduce) -> str | None:
    bad = _mesh_problem(worker, ins.mesh_id, ins.mesh_dim)
    if bad:
        return f"MergedAllReduce: {bad}"
    if len(ins.srcs) != len(ins.dsts):
        return f"MergedAllReduce of {len(ins.srcs)} sources into {len(ins.dsts)} destinations"
    return None


_BODY_TYPES = frozenset(_INSTRUCTION_TYPES - {RunProgram, DefineProgram})


def _define_program(worker, ins: DefineProgram) -> str | None:
    constants = set()
    for i, put in enumerate(ins.constants):
        bad = _put(worker, put) if type(put) is Put else f"a {type(put).__name__}, not a Put"
        if bad is not None:
            return f"program {ins.program_id}: constant {i}: {bad}"
        constants.add(put.tid)
    for i, step in enumerate(ins.instructions):
        if type(step) not in _BODY_TYPES:
            return f"program {ins.program_id}: step {i} is a {type(step).__name__}, which a program cannot hold"
        if type(step) is Constant and step.tid not in constants:
            return f"program {ins.program_id}: step {i} names constant {step.tid!r}, which the program does not hold"
        check = _CHECKS.get(type(step))
        bad = check(worker, step) if check is not None else None
        if bad is not None:
            return f"program {ins.program_id}: step {i}: {bad}"
    return None


_CHECKS = {
    DefineMesh: _define_mesh,
    DefinePlan: _define_plan,
    Put: _put,
    Collective: _collective,
    MergedAllReduce: _merged,
    DefineProgram: _define_program,
}
#: the instruction types :func:`problem` checks (the hot Call is not among them)
CHECKED = frozenset(_CHECKS)


def problem(worker, ins) -> str | None:
    """What is wrong with ``ins`` for this worker (a message), or None."""
    check = _CHECKS.get(type(ins))
    return check(worker, ins) if check is not None else None


def describe(ins, exc: BaseException | None = None, message: str | None = None) -> str:
    """The report of a rejected instruction: its type, the problem and what to do."""
    what = message if message is not None else f"{type(exc).__name__}: {exc}"
    return f"{type(ins).__name__} instruction rejected: {what}{_WHAT_TO_DO}"


def outputs_of(ins) -> tuple:
    """The tensor ids ``ins`` would have written (marked failed when it is rejected)."""
    t = type(ins)
    try:
        if t is Call or t is RunProgram:
            return tuple(x for x in ins.outputs if type(x) is int)
        if t is Collective:
            return (ins.dst,) if type(ins.dst) is int else ()
        if t is MergedAllReduce:
            return tuple(x for x in ins.dsts if type(x) is int)
        if t is Put:
            return (ins.tid,) if type(ins.tid) is int else ()
    except TypeError:
        pass
    return ()
