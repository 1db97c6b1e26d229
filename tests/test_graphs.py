"""The worker side of device graphs (worker/graphs.py), on CPU with a stand-in for CUDA graphs.

The stand-in records the program's work at capture without running it and runs it on each
replay, as a CUDA graph does; the values come out of the graph's own input and output buffers.
The real thing (dtorch_nccl's CUDA graphs) is tested in plugins/dtorch_nccl/tests on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.worker.streams import WorkerStreams

from .helpers import DEVICE
from .test_capture import OPTIMIZERS, train_step
from .test_modules import MLP, distribute_module


class RecordedGraph:
    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


class GraphStreams(WorkerStreams):
    can_capture = True
    fail = False

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return RecordedGraph(fn)


# the stand-in streams are installed into worker threads: inline workers replay through
# expand_program only, process workers live in other processes
pytestmark = pytest.mark.parametrize("_runner_name", ["thread"], indirect=True)


@pytest.fixture
def graph_workers(runner):
    workers = session_module._session.runner.workers
    saved = [w.streams for w in workers]
    for w in workers:
        w.streams = GraphStreams(w.device)
        w.graphs.clear()
    yield workers
    for w, s in zip(workers, saved):
        w.streams = s


def test_training_step_replays_through_the_graph_like_eager(graph_workers):
    mesh = dt.init_device_mesh(DEVICE, (1,))
    torch.manual_seed(0)
    models = [distribute_module(MLP(), mesh, {}) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [OPTIMIZERS["adamw"](m.parameters()) for m in models]
    step = dt.compile(train_step)
    for _ in range(7):
        x = dt.distribute_tensor(torch.randn(10, 12), mesh, [dt.Shard(0)])
        y = dt.distribute_tensor(torch.randn(10, 5), mesh, [dt.Shard(0)])
        got = step(models[0], opts[0], x, y)
        expected = train_step(models[1], opts[1], x, y)
        assert torch.equal(got.full_tensor(), expected.full_tensor())
    kept = got.full_tensor()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())
    state = next(iter(graph_workers[0].graphs.values()))
    # replays 1 (plain), 2 (captured, then launched), 3 and 4 (launched)
    assert state.graph is not None and state.graph.replays == 3
    # an output is a copy: the next replay rewrites the graph's buffers, not the returned tensor
    x = dt.distribute_tensor(torch.randn(10, 12), mesh, [dt.Shard(0)])
    step(models[0], opts[0], x, x[:, :5])
    assert torch.equal(got.full_tensor(), kept)


def test_programs_with_collectives_or_random_ops_replay_without_a_graph(graph_workers, mesh1d):
    x = dt.distribute_tensor(torch.ones(8, 4), mesh1d, [dt.Shard(0)])
    noisy = dt.compile(lambda t: F.dropout(t, 0.5) * 2)
    gathered = dt.compile(lambda t: (t * 2).redistribute(mesh1d, [dt.Replicate()]) + 1)
    outs = [noisy(x).full_tensor() for _ in range(6)]
    assert not torch.equal(outs[4], outs[5])
    for _ in range(5):
        assert torch.equal(gathered(x).full_tensor(), torch.full((8, 4), 3.0))
    (noisy_program,) = noisy._captured.values()
    (gathered_program,) = gathered._captured.values()
    for w in graph_workers:
        assert not w.graphs[noisy_program.program_id].usable
        # a gather among one device is a local copy, which a graph can repeat
        graphed = w.graphs[gathered_program.program_id].graph is not None
        assert graphed == (mesh1d.size() == 1), (w.rank, graphed)


def test_a_failed_capture_falls_back_to_plain_replays(graph_workers):
    mesh = dt.init_device_mesh(DEVICE, (1,))
    for w in graph_workers:
        w.streams.fail = True
    x = dt.distribute_tensor(torch.arange(6.0), mesh, [dt.Shard(0)])
    step = dt.compile(lambda t: (t * 3).relu() - 1)
    for _ in range(6):
        assert torch.equal(step(x).full_tensor(), (torch.arange(6.0) * 3).relu() - 1)
    state = next(iter(graph_workers[0].graphs.values()))
    assert state.graph is None and not state.usable


def test_programs_of_other_inputs_alternate_with_a_graphed_one(graph_workers):
    # every program names its inputs and outputs with the same ids: replays of one program must
    # not take them from another's graph
    mesh = dt.init_device_mesh(DEVICE, (1,))
    lin = distribute_module(torch.nn.Linear(6, 4), mesh, {"weight": [dt.Shard(0)]})
    step = dt.compile(lambda model, x: model(x).relu())
    for shape in [(5, 6), (3, 6)] * 6:
        x = torch.randn(shape)
        out = step(lin, dt.distribute_tensor(x, mesh, [dt.Shard(0)]))
        with torch.no_grad():
            expected = lin(dt.distribute_tensor(x, mesh, [dt.Shard(0)])).relu().full_tensor()
        assert torch.equal(out.full_tensor(), expected)
    assert sum(g.graph is not None for g in graph_workers[0].graphs.values()) == 2
