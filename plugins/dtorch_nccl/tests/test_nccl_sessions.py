"""dtorch sessions on CUDA against plain torch: the thread runner with four virtual devices on one
GPU (communicator ``cuda-inprocess``), the process runner with one worker per GPU (``nccl``), and
two worker processes sharing one GPU with payloads through gloo (NCCL takes one GPU per rank, so
this is how one GPU runs the process runner's device-payload path with real traffic)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, requires_gpu

import dtorch_core as dt

pytestmark = requires_gpu
R, P = dt.Replicate(), dt.Partial("sum")

SESSIONS = {
    "thread-4": dict(world_size=4, runner="thread"),
    "process-1": dict(world_size=1, runner="process"),
    "process-2-gloo": dict(world_size=2, runner="process", dist_backend="gloo"),
}


@pytest.fixture(scope="module", params=list(SESSIONS))
def session(request):
    dt.init(device_type="cuda", **SESSIONS[request.param])
    yield request.param
    dt.shutdown()


@pytest.fixture
def mesh(session):
    dt.manual_seed(0)
    return dt.init_device_mesh("cuda", (SESSIONS[session]["world_size"],))


def test_workers_sit_on_the_gpu(mesh):
    stats = dt.memory_stats()
    assert [s["device"] for s in stats] == [f"cuda:{r % torch.cuda.device_count()}" for r in range(mesh.size())]


# uneven on 4 ranks (3, 3, 3, 1) and on 2 (5, 5)
SHAPE = (10, 6)


@pytest.mark.parametrize("src,dst", [
    (dt.Shard(0), R), (dt.Shard(1), R), (P, R), (P, dt.Shard(0)), (dt.Shard(0), dt.Shard(1)), (R, dt.Shard(1)),
], ids=str)
def test_redistribute_matches_torch(mesh, src, dst):
    a = torch.randn(SHAPE)
    x = dt.distribute_tensor(a, mesh, [src])
    y = x.redistribute(mesh, [dst])
    assert y.placements == (dst,)
    assert_close(y, a)


def test_ops_and_autograd_match_torch(mesh):
    a, b = torch.randn(10, 6), torch.randn(6, 5)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)]).requires_grad_(True)
    w = dt.distribute_tensor(b, mesh, [dt.Shard(1)]).requires_grad_(True)
    loss = F.gelu(x @ w).softmax(dim=1).pow(2).mean()
    ar, br = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ref = F.gelu(ar @ br).softmax(dim=1).pow(2).mean()
    assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    assert_close(x.grad, ar.grad, rtol=1e-4, atol=1e-6)
    assert_close(w.grad, br.grad, rtol=1e-4, atol=1e-6)


def test_bf16_matmul_matches_torch_on_the_gpu(mesh):
    a = torch.randn(64, 128, dtype=torch.bfloat16)
    b = torch.randn(128, 32, dtype=torch.bfloat16)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(b, mesh, [R])
    # the same kernels on the same device: compare with torch on the GPU, not on the CPU
    assert_close((x @ w).full_tensor(), (a.cuda() @ b.cuda()).cpu())


def test_collectives_and_in_place_updates_keep_their_order(mesh):
    """A gather of x, then x changed in place, over and over: each gather must see the x of its
    time (the worker joins before the update overwrites what the collective reads)."""
    a = torch.randn(SHAPE)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    gathered = []
    for _ in range(6):
        gathered.append(x.redistribute(mesh, [R]))
        x.mul_(2)
    for i, g in enumerate(gathered):
        assert_close(g, a * 2**i)
    assert_close(x, a * 2**6)


def test_random_ops_are_reproducible(mesh):
    dt.manual_seed(5)
    r1 = dt.randn(9, 4, device_mesh=mesh, placements=[dt.Shard(0)])
    dt.manual_seed(5)
    r2 = dt.randn(9, 4, device_mesh=mesh, placements=[R])
    assert torch.equal(r1.full_tensor(), r2.full_tensor())
    y = F.dropout(dt.distribute_tensor(torch.ones(9, 4) + 1, mesh, [dt.Shard(0)]), 0.5, training=True)
    full = y.full_tensor()
    assert set(full.unique().tolist()) <= {0.0, 4.0}


def test_memory_stats_follow_the_gpu_allocations(session, mesh):
    # a worker reads its GPU's counters when it answers; workers sharing a GPU (thread runner)
    # answer one after another, so every read follows a synchronize that all of them finished
    world = mesh.size()
    dt.synchronize()
    before = dt.memory_stats()
    big = dt.zeros(2048, 1024, device_mesh=mesh, placements=[dt.Shard(0)])
    dt.synchronize()
    during = dt.memory_stats()
    shard = 2048 * 1024 * 4 // world
    for b, d in zip(before, during):
        assert d["bytes"] >= b["bytes"] + shard
        assert d["device_peak_allocated_bytes"] >= d["device_allocated_bytes"]
        assert d["device_reserved_bytes"] >= d["device_allocated_bytes"]
    # counters are per GPU and per process: the thread runner's workers that share a GPU see
    # every shard on it, a worker process only its own
    count = torch.cuda.device_count()
    on_gpu0 = sum(1 for r in range(world) if r % count == 0) if SESSIONS[session]["runner"] == "thread" else 1
    grown = shard * on_gpu0
    assert during[0]["device_allocated_bytes"] >= before[0]["device_allocated_bytes"] + grown
    del big
    dt.synchronize()
    after = dt.memory_stats()
    assert after[0]["device_allocated_bytes"] <= during[0]["device_allocated_bytes"] - grown
    assert after[0]["device_peak_allocated_bytes"] >= during[0]["device_allocated_bytes"]
