"""dt.nn.fully_shard: FSDP-style parameters train like plain torch and hold ~1/dp of the memory."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import assert_close, needs_world_size, train
from .test_modules import MLP, Block


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def block_loss(out, target):
    return F.mse_loss(out, target)


def check_sharded(model, ref, dp_dim: int):
    """Parameters (and their grads) are Shard(0) on the dp dim and equal torch's."""
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert p._spec.placements[dp_dim] == dt.Shard(0), name
        assert p.grad._spec.placements[dp_dim] == dt.Shard(0), f"{name}.grad is {p.grad.placements}"
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)


@needs_world_size(4)
def test_mlp_trains_like_torch(mesh1d):
    torch.manual_seed(0)
    ref = MLP(d_in=6, hidden=10, d_out=7)  # 10 and 7 rows over 4 ranks: 3,3,3,1 and 2,2,2,1
    model = dt.nn.fully_shard(copy.deepcopy(ref), mesh1d)
    assert [t.shape[0] for t in model.fc1.weight.local_shards().values()] == [3, 3, 3, 1]
    batches = [(torch.randn(5, 6), torch.randn(5, 7)) for _ in range(3)]  # 5 rows: 2,1,1,1
    got = train(model, batches, adamw, F.mse_loss, 3)
    assert got == pytest.approx(train(ref, batches, adamw, F.mse_loss, 3), rel=1e-4)
    check_sharded(model, ref, 0)
    assert dt.fallback_counts() == {}


def test_tied_parameters_stay_one(mesh1d):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11, bias=False))
    ref[1].weight = ref[0].weight
    model = dt.nn.fully_shard(copy.deepcopy(ref), mesh1d)
    assert model[1].weight is model[0].weight and len(list(model.parameters())) == 1
    batches = [(torch.randint(0, 11, (5,)), torch.randint(0, 11, (5,))) for _ in range(2)]
    got = train(model, batches, adamw, F.cross_entropy, 2)
    assert got == pytest.approx(train(ref, batches, adamw, F.cross_entropy, 2), rel=1e-4)
    check_sharded(model, ref, 0)


def test_transformer_block_trains_like_torch(mesh1d):
    torch.manual_seed(0)
    ref = Block(d=12, heads=3, ff=30)  # ff rows 8,8,8,6
    model = dt.nn.fully_shard(copy.deepcopy(ref), mesh1d)
    # 3 sequences over 4 ranks: the last one gets none
    batches = [(torch.randn(3, 5, 12), torch.randn(3, 5, 12)) for _ in range(2)]
    got = train(model, batches, adamw, block_loss, 2)
    assert got == pytest.approx(train(ref, batches, adamw, block_loss, 2), rel=1e-4)
    check_sharded(model, ref, 0)
    assert dt.fallback_counts() == {}


def test_with_tensor_parallel_after_materialize(mesh2d):
    # the whole stack: build on meta, materialize with a tp plan, then shard over dp
    torch.manual_seed(0)
    ref = Block(d=16, heads=4, ff=42)
    with dt.nn.meta_init():
        model = Block(d=16, heads=4, ff=42)
    col, row = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    tp_plan = {"q": col(), "k": col(), "v": col(), "proj": row(), "fc": col(), "out": row()}
    dt.nn.materialize(model, mesh2d["tp"], tp_plan, seed=0)
    dt.nn.fully_shard(model, mesh2d["dp"])
    assert model.fc.weight._spec.placements == (dt.Shard(0), dt.Shard(0))  # dp and tp nest on rows
    assert model.out.weight._spec.placements == (dt.Shard(0), dt.Shard(1))
    assert model.ln1.weight._spec.placements == (dt.Shard(0), dt.Replicate())
    batches = [(torch.randn(3, 5, 16), torch.randn(3, 5, 16)) for _ in range(2)]  # 3 over dp 2: 2, 1
    got = train(model, batches, adamw, block_loss, 2)
    assert got == pytest.approx(train(ref, batches, adamw, block_loss, 2), rel=1e-4)
    check_sharded(model, ref, 0)
    assert dt.fallback_counts() == {}


@needs_world_size(4)
def test_memory_is_the_shards_plus_one_module(mesh1d):
    torch.manual_seed(0)
    ref = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    layer = full // 4

    def held():
        return [s["bytes"] for s in dt.memory_stats()]

    gc.collect()  # earlier tests' handles kept by reference cycles go now, not between the two counts
    gc.disable()
    try:
        base = held()
        model = dt.nn.fully_shard(copy.deepcopy(ref), mesh1d)
        stored = [b - b0 for b, b0 in zip(held(), base)]
    finally:
        gc.enable()
    assert stored == [full // 4] * 4  # 64 rows (and 64 biases) over 4 ranks

    during = []
    for lin in model:  # after the gather hooks: the module's parameters are gathered now
        lin.register_forward_pre_hook(lambda m, a: during.append(max(held())))
    x = torch.randn(2, 64)
    with torch.no_grad():
        model(x)
    activations = 2 * 64 * 4 * 3  # input and a couple of (2, 64) activations
    assert all(b - max(base) <= full // 4 + layer + activations for b in during), during

    during.clear()
    out = model(x)  # autograd keeps the gathered weights, but not their memory
    after_forward = max(held()) - max(base)
    assert max(during) - max(base) <= full // 4 + layer + 4 * activations
    assert after_forward <= full // 4 + 4 * activations
    out.sum().backward()
    ref(x).sum().backward()
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6)
