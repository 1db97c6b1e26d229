"""Device graphs of replayed programs (CUDA graphs through the ``dtorch_nccl`` streams).

A program replayed on a device whose streams can capture (``WorkerStreams.can_capture``) runs
its first replay as usual, is captured into a device graph on its second, and from then on
runs as one graph launch: the inputs are copied into the graph's own input buffers, the graph
replays every kernel of the step, and the outputs are copied out (the graph's buffers are
rewritten by the next replay). State the program updates in place (parameters, optimizer state)
keeps its memory, so the graph updates it where it lives; tensors the program makes and keeps
(``.grad``) live in the graph's memory pool and are rewritten in place by every replay.

Programs that a graph cannot repeat run without one: random ops (their seeds change per replay),
a ``Put`` in the body (data from the controller; captured programs hold none: the tensors a step
sent are program constants, on the device since the program was defined, see
``ir/program.py``), and collectives among several devices (NCCL can be captured, but capturing
every rank's graph in step is not done or tested yet). A capture that fails (an op that synchronises with the host, say) is
logged once and the program runs without a graph from then on.
"""

from __future__ import annotations

import attrs
import structlog
import torch

from ..ir.instructions import COMMUNICATING_KINDS, Collective, MergedAllReduce, Put, WorkerFailure

log = structlog.get_logger(__name__)
WARM_UP_REPLAYS = 1  # plain replays before capture (lazy allocations, library handles)


@attrs.define
class GraphState:
    usable: bool
    replays: int = 0
    graph: object = None
    inputs: list = attrs.field(factory=list)  # the graph's input buffers, per program input
    outputs: list = attrs.field(factory=list)  # the graph's output tensors, per program output
    fused_runs: int = 0  # fused segments a launch runs without running their Python


def graphable(worker, program) -> bool:
    """Whether a device graph can repeat ``program`` (see the module docstring)."""
    if program.seeded:
        return False
    for ins in program.instructions:
        t = type(ins)
        if t is Put:
            return False
        if t is MergedAllReduce or (t is Collective and ins.kind in COMMUNICATING_KINDS):
            view = worker.meshes.get(ins.mesh_id)
            if view is not None and view.groups[ins.mesh_dim][2] > 1:
                return False  # a group of one is a local copy (see Worker._collective)
    return True


def replay_graphed(worker, run) -> bool:
    """Run ``run`` (a RunProgram) through the program's device graph; False: run it plainly."""
    program = worker.programs.get(run.program_id)
    if program is None:
        return False
    state = worker.graphs.get(run.program_id)
    if state is None:
        state = worker.graphs[run.program_id] = GraphState(graphable(worker, program))
    if not state.usable:
        return False
    store = worker.store
    values = [store.get(tid) for tid in run.inputs]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return False  # a missing or failed input: the plain path reports it
    if state.graph is None:
        state.replays += 1
        if state.replays <= WARM_UP_REPLAYS:
            return False
        if not _capture(worker, program, state, values):
            return False
    else:
        for buffer, value in zip(state.inputs, values):
            buffer.copy_(value)
    # every program names its inputs and outputs with the same ids, so another program's replay
    # may have taken them over in the store: give them back to this graph's buffers
    for pid, buffer in zip(program.inputs, state.inputs):
        store[pid] = buffer
    for pid, out in zip(program.output_ids, state.outputs):
        if out is not None:
            store[pid] = out
    fused_before = worker.fused_runs
    state.graph.replay()
    if worker.fused_runs == fused_before:  # a real device graph: count the segments it ran
        worker.fused_runs += state.fused_runs
    for pid, tid in zip(program.output_ids, run.outputs):
        value = store.get(pid)
        if isinstance(value, torch.Tensor):
            value = value.clone()  # the graph's buffer is rewritten by the next replay
        elif value is None:
            value = WorkerFailure(worker.rank, "replay", None, f"the graph's output {pid} is missing")
        store[tid] = value
    return True


def _capture(worker, program, state: GraphState, values) -> bool:
    store = worker.store
    state.inputs = [v.clone() for v in values]
    for pid, buffer in zip(program.inputs, state.inputs):
        store[pid] = buffer
    fused_before = worker.fused_runs
    try:
        state.graph = worker.streams.capture(lambda: [worker.execute(ins) for ins in program.instructions])
    except Exception as exc:
        state.graph = None
        log.warning("device graph capture failed; this program replays without one",
                    rank=worker.rank, error=f"{type(exc).__name__}: {exc}")
    # a capture records fused segments without running them; the launch that follows runs them
    captured_runs, worker.fused_runs = worker.fused_runs - fused_before, fused_before
    if state.graph is None:
        state.usable = False
        state.inputs = []
        for pid in program.inputs:
            store.pop(pid, None)
        return False
    state.outputs = [store.get(pid) for pid in program.output_ids]
    state.fused_runs = captured_runs
    log.debug("program captured as a device graph", rank=worker.rank, instructions=len(program.instructions))
    return True

