"""Tensors a captured step sends from the controller are constants of its program (ir/program.py).

They go to the workers once, with the program, and stay until it is dropped; a replay holds no
``Put`` (so a device graph can repeat it), and one that writes into such a tensor starts the
next replay from the capture's value again, as the eager step does.
"""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Constant, DefineProgram, Put, RunProgram
from dtorch_core.runners.process import for_rank
from dtorch_core.worker.graphs import graphable
from dtorch_core.worker.programs import BoundConstant, LoadedProgram

from .helpers import DEVICE, WORLD_SIZE, assert_close
from .test_graphs import graph_workers  # noqa: F401 - the fixture, shared

CLOSED_OVER = torch.randn(8)


def scaled(x):
    """Makes a plain tensor inside (as diffusers' timestep embedding does) and reads one made outside."""
    return (x * torch.arange(8.0) + CLOSED_OVER).sum(0)


def written_into(x, mesh, kept):
    """Writes in place into a tensor it sent, keeps another and returns a third."""
    c = dt.distribute_tensor(torch.arange(8.0), mesh)
    c.mul_(2)
    kept.k = dt.distribute_tensor(torch.full((8,), 3.0), mesh)
    return x * c + kept.k, dt.distribute_tensor(torch.ones(8), mesh)


def only_program(f):
    (entry,) = f._captured.values()
    return entry


def thread_workers():
    return session_module._session.runner.workers


def test_a_tensor_made_inside_the_step_replays_as_a_constant(mesh1d):
    f = dt.compile(scaled)
    for _ in range(6):
        x = torch.randn(6, 8)
        got = f(dt.distribute_tensor(x, mesh1d, [dt.Shard(0)]))
        assert_close(got.full_tensor(), scaled(x))
    assert f.replays == 3
    program = only_program(f).program
    assert not any(type(ins) is Put for ins in program.instructions)
    steps = [ins for ins in program.instructions if type(ins) is Constant]
    # arange and the closed-over tensor; only read by pure ops: shared by every replay, bound first
    assert len(program.constants) == 2 and [s.copy for s in steps] == [False, False]
    assert program.instructions[:2] == tuple(steps)


def test_a_replay_sends_no_tensor_data(mesh1d, runner):
    f = dt.compile(scaled)
    for _ in range(3):
        f(dt.distribute_tensor(torch.randn(6, 8), mesh1d, [dt.Shard(0)]))
    entry = only_program(f)
    # what goes on the wire per replay: ids and seeds only (the data went once, with the program)
    run = RunProgram(entry.program_id, (1 << 30,), (1 << 30,), 1 << 40, 1 << 20)
    assert len(wire.encode([run])) < 64
    define = DefineProgram(entry.program_id, entry.program.instructions, entry.program.inputs,
                           entry.program.outputs, entry.program.fusable, entry.program.constants)
    # each process worker gets only its own shard of every constant
    for rank in range(WORLD_SIZE):
        (mine,) = for_rank([define], rank)
        assert all(set(put.shards) <= {rank} for put in mine.constants)
    if runner != "thread":
        return
    dt.synchronize()  # the capture's own transfers (and the constants', once, at define) are done
    moved = []
    for w in thread_workers():
        def counting(value, w=w, to_device=w.streams.to_device):
            moved.append(w.rank)
            return to_device(value)
        w.streams.to_device = counting
    try:
        for _ in range(3):
            x = torch.randn(6, 8)
            assert_close(f(dt.distribute_tensor(x, mesh1d, [dt.Shard(0)])).full_tensor(), scaled(x))
        dt.synchronize()
        # three replays; the only transfers are the three inputs' shards, none for the constants
        assert f.replays == 3 and len(moved) == 3 * WORLD_SIZE
    finally:
        for w in thread_workers():
            vars(w.streams).pop("to_device", None)


@pytest.mark.parametrize("_runner_name", ["thread"], indirect=True)
def test_a_program_whose_only_put_became_a_constant_is_graphable(mesh1d):
    f = dt.compile(scaled)
    for _ in range(3):
        f(dt.distribute_tensor(torch.randn(6, 8), mesh1d, [dt.Shard(0)]))
    dt.synchronize()
    worker = thread_workers()[0]
    loaded = worker.programs[only_program(f).program_id]
    assert any(type(s) is BoundConstant for s in loaded.instructions)
    assert graphable(worker, loaded)
    # the same body with the data sent per replay, as before constants: not graphable
    as_puts = [Put(s.tid, 1, {worker.rank: s.value}) if type(s) is BoundConstant else s for s in loaded.instructions]
    old = LoadedProgram(as_puts, loaded.seeded, loaded.inputs, loaded.outputs, loaded.output_ids)
    assert not graphable(worker, old)


def test_writes_into_a_constant_do_not_reach_the_next_replay(mesh1d):
    f = dt.compile(written_into)
    kept = types.SimpleNamespace()  # an object argument (a dict would be flattened into the guard)
    for i in range(6):
        x = torch.randn(8)
        out, ones = f(dt.distribute_tensor(x, mesh1d, [dt.Shard(0)]), mesh1d, kept)
        assert_close(out.full_tensor(), x * torch.arange(8.0) * 2 + 3)
        assert torch.equal(ones.full_tensor(), torch.ones(8))
        # eager writes into what the step kept and returned: the next replay starts from the capture's values
        kept.k.add_(100)
        ones.add_(5)
    assert f.replays == 3
    program = only_program(f).program
    assert not any(type(ins) is Put for ins in program.instructions)
    assert len(program.constants) == 3
    assert all(s.copy for s in program.instructions if type(s) is Constant)


@pytest.mark.parametrize("_runner_name", ["thread"], indirect=True)
@pytest.mark.parametrize("step", ["scaled", "written_into"])
def test_a_step_with_constants_replays_through_the_device_graph(graph_workers, step):  # noqa: F811 - the fixture
    mesh = dt.init_device_mesh(DEVICE, (1,))  # device graphs: no collective among several devices
    kept = types.SimpleNamespace()  # an object argument (a dict would be flattened into the guard)
    if step == "scaled":
        f = dt.compile(scaled)
        call, expected = (lambda x: f(x)), scaled
    else:
        f = dt.compile(written_into)
        call, expected = (lambda x: f(x, mesh, kept)[0]), (lambda x: x * torch.arange(8.0) * 2 + 3)
    for _ in range(7):
        x = torch.randn(6, 8) if step == "scaled" else torch.randn(8)
        assert_close(call(dt.distribute_tensor(x, mesh, [dt.Shard(0)])).full_tensor(), expected(x))
    state = graph_workers[0].graphs[only_program(f).program_id]
    # replays 1 (plain), 2 (captured, then launched), 3 and 4 (launched)
    assert state.usable and state.graph is not None and state.graph.replays == 3


@pytest.mark.parametrize("_runner_name", ["thread"], indirect=True)
@pytest.mark.parametrize("how", ["reset", "dropped", "recaptured"])
def test_constants_are_freed_with_their_program(mesh1d, how):
    f = dt.compile(scaled)
    for _ in range(3):
        f(dt.distribute_tensor(torch.randn(6, 8), mesh1d, [dt.Shard(0)]))
    dt.synchronize()
    pid = only_program(f).program_id
    worker = thread_workers()[0]
    constants = [weakref.ref(s.value) for s in worker.programs[pid].instructions if type(s) is BoundConstant]
    assert len(constants) == 2
    if how == "reset":
        f.reset()
    elif how == "dropped":
        del f
    else:
        f.max_programs = 1  # another input signature evicts the first program
        for _ in range(3):
            f(dt.distribute_tensor(torch.randn(4, 8), mesh1d, [dt.Shard(0)]))
    gc.collect()
    dt.synchronize()
    assert all(pid not in w.programs and pid not in w.graphs for w in thread_workers())
    assert all(ref() is None for ref in constants)
