"""Ops that torch reaches only on some devices or versions, called directly so every device runs
them: F.rms_norm's fused op (CUDA), constant_pad_nd (F.pad; SDPA pads bool masks on CUDA),
leaky_relu (untagged before torch 2.13) and composite ops handed to dispatch unexpanded. Each is
checked against plain torch, uneven shards included, Partial placements where the rule keeps them."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import check_op, on_mesh

aten = torch.ops.aten
R, P, S = dt.Replicate(), dt.Partial("sum"), dt.Shard


@pytest.mark.skipif(not hasattr(aten, "_fused_rms_norm"), reason="this torch has no _fused_rms_norm")
@pytest.mark.parametrize("spec", [(S(0), R), (S(1), S(0)), (R, R)], ids=str)
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_rms_norm_and_its_backward(mesh, spec, weighted):
    x = torch.randn(6, 5, 8)
    w = torch.randn(8) if weighted else None

    def fn(x, *w):
        return aten._fused_rms_norm(x, [8], w[0] if w else None, 1e-5)[0]

    inputs = [x] + ([w] if weighted else [])
    placements = [on_mesh(mesh, spec)] + ([on_mesh(mesh, (R, R))] if weighted else [])
    check_op(fn, inputs, placements, mesh)


@pytest.mark.parametrize("pad,value", [((1, 2), 0.0), ((0, 0, 2, 1), 0.0), ((1, 1), -3.0), ((-1, 2), 0.0)], ids=str)
@pytest.mark.parametrize("spec", [(S(0), R), (S(1), S(0)), (S(2), R), (P, R), (R, R)], ids=str)
def test_constant_pad_nd(mesh, pad, value, spec):
    x = torch.randn(7, 5, 6)
    padded = {2 - i // 2 for i, p in enumerate(pad) if p}
    full = on_mesh(mesh, spec)
    keeps = all(not (isinstance(p, dt.Shard) and p.dim in padded) for p in full) and (
        value == 0 or not any(isinstance(p, dt.Partial) for p in full))
    out = check_op(lambda t: aten.constant_pad_nd(t, list(pad), value), [x], [full], mesh)
    if keeps:  # a shard on a dim the pad leaves alone, or a Partial that survives: no gather
        assert out.placements == tuple(full)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64])
def test_composite_ops_handed_to_dispatch_expand_like_torch(mesh, dtype):
    """Ops torch composes from others (``to``, ``type_as``) reach ``__torch_dispatch__`` unexpanded
    when a decomposition inside dispatch calls them (torch 2.11): they expand as torch does. The
    same dtype gives the tensor itself, another one a copy that keeps the placement."""
    from dtorch_core.planner.dispatch import dispatch

    x, other = torch.randn(7, 4), torch.zeros(7, 4, dtype=dtype)
    xd = dt.distribute_tensor(x, mesh, on_mesh(mesh, (S(0), R)))
    od = dt.distribute_tensor(other, mesh, on_mesh(mesh, (R, R)))
    for y in (dispatch(aten.to.dtype, (xd, dtype), {}), dispatch(aten.type_as.default, (xd, od), {})):
        assert (y is xd) == (dtype == torch.float32)
        assert y.dtype == dtype and y.placements == xd.placements
        torch.testing.assert_close(y.full_tensor(), x.to(dtype))


@pytest.mark.parametrize("spec", [(S(0), R), (S(1), S(0)), (R, R)], ids=str)
def test_leaky_relu(mesh, spec):
    x = torch.randn(9, 4)
    check_op(lambda t: aten.leaky_relu(t, 0.1), [x], [on_mesh(mesh, spec)], mesh,
             expect_placements=on_mesh(mesh, spec))
