"""Programs on the worker: a DefineProgram is loaded once, and each RunProgram replays it.

A replay is the program's body between two worker-local steps: :class:`BindInputs` names the
caller's tensors with the program's input ids, :class:`NameOutputs` gives the program's outputs
the caller's fresh ids. Seeded calls get fresh seeds per replay (from the run's seed and counter).
"""

from __future__ import annotations

import attrs

from ..ir.instructions import (
    Call,
    Constant,
    DefineProgram,
    Delete,
    RunProgram,
    WorkerFailure,
    program_seed,
)
from .fused import FusedSegment, split


@attrs.frozen
class BindInputs:
    """Worker-local step of a replay: the program's input ids name the caller's tensors."""

    pairs: tuple  # (program input id, tensor id)


@attrs.frozen
class NameOutputs:
    """Worker-local step of a replay: the caller's fresh ids take the program's outputs."""

    pairs: tuple  # (program output id, fresh tensor id, move: the program's id is dropped)
    drop: tuple  # program input ids to forget


@attrs.frozen
class BoundConstant:
    """Worker-local step of a replay: ``tid`` names the program's constant ``value`` (this rank's
    tensor, on the device), or with ``copy`` a fresh copy of it (the program may write into it)."""

    tid: int
    value: object
    copy: bool


@attrs.define
class LoadedProgram:
    instructions: list
    seeded: tuple  # positions of seeded Calls (their ``seed`` is the index among them)
    inputs: tuple
    outputs: frozenset  # the program's own output ids (moved to the fresh ids after a replay)
    output_ids: tuple


class WorkerPrograms:
    """Defining and expanding programs on :class:`~dtorch_core.worker.loop.Worker` (a mixin).

    Uses the worker's ``rank``, ``programs``, ``streams``, ``fused_segments`` and ``_fail``.
    """

    def _define_program(self, ins: DefineProgram) -> None:
        body = self._bind_constants(ins)
        if ins.fusable:
            # the same segments on every rank (they depend on the program only): the inline
            # runner steps all ranks through a replay together
            body = split(body, ins.fusable, ins.outputs)
            self.fused_segments += sum(type(x) is FusedSegment for x in body)
        seeded = tuple(i for i, x in enumerate(body) if type(x) is Call and x.seed is not None)
        self.programs[ins.program_id] = LoadedProgram(body, seeded, tuple(ins.inputs), frozenset(ins.outputs),
                                                      tuple(ins.outputs))

    def _bind_constants(self, ins: DefineProgram) -> list:
        """The body with each Constant step holding this rank's constant, moved to the device now
        (one copy per program, not per replay); steps for ranks without a shard do nothing."""
        if not ins.constants:
            return list(ins.instructions)
        values = {}
        for put in ins.constants:
            shard = put.shards.get(self.rank)
            if shard is not None:
                values[put.tid] = self.streams.to_device(shard)
        body = []
        for step in ins.instructions:
            if type(step) is Constant:
                value = values.get(step.tid)
                step = BoundConstant(step.tid, value, step.copy) if value is not None else Delete((step.tid,))
            body.append(step)
        return body

    def expand_program(self, run: RunProgram) -> list:
        """The steps of one replay: bind inputs, the body (fresh seeds), name outputs."""
        program = self.programs.get(run.program_id)
        if program is None:
            self._fail(run.outputs, WorkerFailure(self.rank, "replay", None,
                                                  f"program {run.program_id} is not defined on this worker"))
            return []
        body = program.instructions
        if program.seeded:
            body = body.copy()
            for i in program.seeded:
                call = body[i]
                body[i] = attrs.evolve(call, seed=program_seed(run.seed, run.seed_counter + call.seed + 1))
        bind = BindInputs(tuple(zip(program.inputs, run.inputs)))
        name = NameOutputs(
            tuple((pid, tid, pid in program.outputs) for pid, tid in zip(program.output_ids, run.outputs)),
            program.inputs,
        )
        return [bind, *body, name]
