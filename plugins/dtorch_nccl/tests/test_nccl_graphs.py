"""Replayed programs run as CUDA graphs: equal to eager steps, and really graphed.

Thread runner (virtual devices on one GPU, where the test can look at the workers) and the
process runner with one worker. Programs with collectives or random ops replay without a graph
(see dtorch_core/worker/graphs.py); that path is checked too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_gpu

import dtorch_core as dt
from dtorch_core.controller import session as session_module

pytestmark = requires_gpu


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))


def graphed_programs():
    runner = session_module._session.runner
    workers = getattr(runner, "workers", None)
    if workers is None:
        return None  # worker processes: not visible from here
    return [sum(1 for g in w.graphs.values() if g.graph is not None) for w in workers]


@pytest.mark.parametrize("runner,world", [("thread", 1), ("thread", 2), ("process", 1)])
def test_replayed_training_step_runs_as_a_cuda_graph(runner, world):
    dt.init(world_size=world, runner=runner, device_type="cuda")
    try:
        mesh = dt.init_device_mesh("cuda", (world,))
        torch.manual_seed(0)
        ref = mlp()
        # parameters replicated, batch sharded: forward and backward need no collective on
        # one device; on two, the gradients are Partial and their all-reduce keeps the graph out
        models = [dt.nn.parallelize_module(copy.deepcopy(ref), mesh, {}) for _ in range(2)]
        opts = [dt.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        step = dt.compile(train_step)
        for i in range(8):
            x = dt.distribute_tensor(torch.randn(10, 12), mesh, [dt.Shard(0)])
            y = dt.distribute_tensor(torch.randn(10, 5), mesh, [dt.Shard(0)])
            a = step(models[0], opts[0], x, y).full_tensor()
            b = train_step(models[1], opts[1], x, y).full_tensor()
            assert torch.equal(a, b), (i, a, b)
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor())
        graphed = graphed_programs()
        if graphed is not None:
            assert graphed == ([1] * world if world == 1 else [0] * world), graphed
    finally:
        dt.shutdown()


def test_random_programs_replay_without_a_graph_and_stay_fresh():
    dt.init(world_size=1, runner="thread", device_type="cuda")
    try:
        mesh = dt.init_device_mesh("cuda", (1,))
        x = dt.distribute_tensor(torch.ones(64, 8), mesh, [dt.Shard(0)])
        noisy = dt.compile(lambda t: F.dropout(t, 0.5) * 3)
        outs = [noisy(x).full_tensor() for _ in range(6)]
        assert not torch.equal(outs[4], outs[5])
        assert graphed_programs() == [0]
    finally:
        dt.shutdown()
