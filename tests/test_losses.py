"""Losses over uneven batch shards equal plain torch (the per-shard-mean trap)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import assert_close

LOSSES = {
    "mse": lambda x, y, r: F.mse_loss(x, y, reduction=r),
    "l1": lambda x, y, r: F.l1_loss(x, y, reduction=r),
    "smooth_l1": lambda x, y, r: F.smooth_l1_loss(x, y, reduction=r, beta=0.5),
    "huber": lambda x, y, r: F.huber_loss(x, y, reduction=r, delta=0.7),
    "bce": lambda x, y, r: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y), reduction=r),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("sharded", [True, False], ids=["uneven_shards", "replicated"])
def test_loss_on_uneven_shards(mesh, name, reduction, sharded):
    fn = LOSSES[name]
    x = torch.randn(7, 3, requires_grad=True)
    y = torch.randn(7, 3)
    # 7 rows on 4 or 2 ranks: uneven; replicated inputs run torch's own loss op on each worker
    place = [dt.Shard(0)] + [dt.Shard(1)] * (mesh.ndim - 1) if sharded else [dt.Replicate()] * mesh.ndim
    dx = dt.distribute_tensor(x.detach(), mesh, place).requires_grad_()
    dy = dt.distribute_tensor(y, mesh, place)
    dt.set_strict(True)
    out = fn(dx, dy, reduction)
    expected = fn(x, y, reduction)
    assert_close(out, expected.detach())
    grad = torch.randn_like(expected)
    out.backward(dt.distribute_tensor(grad, mesh, [dt.Replicate()] * mesh.ndim) if expected.ndim == 0 else
                 dt.distribute_tensor(grad, mesh, place))
    expected.backward(grad)
    assert_close(dx.grad, x.grad)
    assert not dt.fallback_counts()
