"""Ordinary nn.Modules with distributed parameters train like plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import assert_close, train


class MLP(nn.Module):
    def __init__(self, d_in=12, hidden=20, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP)."""

    def __init__(self, d=16, heads=4, ff=40):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # no key bias: its gradient is zero up to rounding, which AdamW would turn into noise
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, ff)
        self.out = nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def distribute_module(model: nn.Module, mesh, plan: dict) -> nn.Module:
    """Replace every parameter with a distributed one (placements from ``plan``, else Replicate)."""
    for name, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            placements = plan.get(full, [dt.Replicate()] * mesh.ndim)
            setattr(module, pname, nn.Parameter(dt.distribute_tensor(p.detach(), mesh, placements)))
    return model


def tp_plan_mlp(mesh):
    r = [dt.Replicate()] * (mesh.ndim - 1)
    return {
        "fc1.weight": r + [dt.Shard(0)],
        "fc1.bias": r + [dt.Shard(0)],
        "fc2.weight": r + [dt.Shard(1)],
    }


def tp_plan_block(mesh):
    r = [dt.Replicate()] * (mesh.ndim - 1)
    return {
        "q.weight": r + [dt.Shard(0)],
        "q.bias": r + [dt.Shard(0)],
        "k.weight": r + [dt.Shard(0)],
        "v.weight": r + [dt.Shard(0)],
        "v.bias": r + [dt.Shard(0)],
        "fc.weight": r + [dt.Shard(0)],
        "fc.bias": r + [dt.Shard(0)],
        "out.weight": r + [dt.Shard(1)],
        "proj.weight": r + [dt.Shard(1)],
    }


@pytest.mark.parametrize("foreach", [True, False])
def test_mlp_trains_like_torch(mesh, foreach):
    torch.manual_seed(0)
    ref = MLP()
    model = distribute_module(copy.deepcopy(ref), mesh, tp_plan_mlp(mesh))
    batch_place = [dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1)
    data = [(torch.randn(10, 12), torch.randn(10, 5)) for _ in range(4)]
    dist_data = [(dt.distribute_tensor(x, mesh, batch_place), dt.distribute_tensor(y, mesh, batch_place)) for x, y in data]

    def opt(params):
        return torch.optim.AdamW(params, lr=1e-2, foreach=foreach)

    expected = train(ref, data, opt, F.mse_loss, 4, clip=1.0)
    got = train(model, dist_data, opt, F.mse_loss, 4, clip=1.0)
    assert dt.fallback_counts() == {}
    assert got == pytest.approx(expected, rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_transformer_block_trains_like_torch(mesh):
    torch.manual_seed(0)
    ref = Block()
    model = distribute_module(copy.deepcopy(ref), mesh, tp_plan_block(mesh))
    place = [dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1)
    data = [(torch.randn(3, 7, 16), torch.randn(3, 7, 16)) for _ in range(3)]
    dist_data = [(dt.distribute_tensor(x, mesh, place), dt.distribute_tensor(y, mesh, place)) for x, y in data]

    def opt(params):
        return torch.optim.AdamW(params, lr=1e-2)

    expected = train(ref, data, opt, F.mse_loss, 3)
    got = train(model, dist_data, opt, F.mse_loss, 3)
    assert dt.fallback_counts() == {}
    assert got == pytest.approx(expected, rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_state_dict_and_no_grad(mesh1d):
    torch.manual_seed(0)
    ref = MLP()
    model = distribute_module(copy.deepcopy(ref), mesh1d, tp_plan_mlp(mesh1d))
    sd = model.state_dict()
    assert set(sd) == set(ref.state_dict())
    for k, v in sd.items():
        assert isinstance(v, dt.DTensor)
        assert_close(v, ref.state_dict()[k])
    x = torch.randn(6, 12)
    with torch.no_grad():
        out = model(dt.distribute_tensor(x, mesh1d, [dt.Replicate()]))
    assert not out.requires_grad
    assert_close(out, ref(x).detach())
