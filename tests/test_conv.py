"""Convolution-network ops against plain torch: convolution (2-D, transposed, grouped), group
norm and nearest upsampling, forward and backward, on every runner.

Batch shards (uneven and empty: batches of 5 and 3 on 4 ranks) pass through as local calls with
no communication; output-channel shards of the weight give channel-sharded outputs; spatial
shards, which these rules do not serve, are gathered and stay exact. Strict mode is on, so a
replicated fallback fails the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import assert_close, check, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1, S2 = dt.Shard(0), dt.Shard(1), dt.Shard(2)


@pytest.fixture(autouse=True)
def strict(runner):
    """Every op in this file has a native rule: a replicated fallback raises."""
    dt.set_strict(True)


def _conv(stride=1, padding=1, dilation=1, groups=1):
    return lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)


# (name, fn, input shape, weight shape, specs of input/weight/bias (2-D; a 1-D mesh takes the
# first non-Replicate entry), the output placement expected on the 2-D mesh)
CONV_CASES = [
    ("batch", _conv(), (5, 3, 6, 7), (4, 3, 3, 3), [(S0, R), (R, R), (R, R)], (S0, R)),
    ("batch-of-3", _conv(), (3, 3, 5, 5), (4, 3, 3, 3), [(R, S0), (R, R), (R, R)], (R, S0)),
    ("out-channels", _conv(), (2, 3, 5, 6), (7, 3, 3, 3), [(R, R), (R, S0), (R, S0)], (R, S1)),
    ("batch-and-out-channels", _conv(), (5, 3, 5, 6), (7, 3, 3, 3), [(S0, R), (R, S0), (R, S0)], (S0, S1)),
    ("strided-dilated", _conv(stride=2, padding=2, dilation=2), (5, 2, 9, 8), (3, 2, 3, 3),
     [(S0, S0), (R, R), (R, R)], (S0, S0)),
    ("grouped", _conv(groups=3), (5, 6, 5, 5), (9, 2, 3, 3), [(S0, R), (R, R), (R, R)], (S0, R)),
    ("transposed", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
     (5, 4, 3, 4), (4, 6, 3, 3), [(S0, R), (R, S1), (R, S0)], (S0, S1)),
    ("spatial-gathered", _conv(), (2, 3, 9, 5), (4, 3, 3, 3), [(R, S2), (R, R), (R, R)], None),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c[0])
def test_conv2d(mesh, case):
    _, fn, x_shape, w_shape, specs, placements = case
    out_channels = w_shape[1] if case[0] == "transposed" else w_shape[0]
    x, w, b = torch.randn(x_shape), torch.randn(w_shape), torch.randn(out_channels)
    out = check(mesh, fn, [x, w, b], specs, grad=(0, 1, 2), atol=1e-4, rtol=1e-4)
    if placements is not None and mesh.ndim == 2:
        assert out[0].placements == placements


@pytest.mark.parametrize("spec", [(S0, R), (S1, R), (P, R)], ids=["batch", "in-channels", "partial"])
def test_conv2d_without_bias(mesh, spec):
    """No bias: an input-channel shard of input and weight is a Partial sum; a Partial input
    passes through."""
    x, w = torch.randn(5, 4, 6, 6), torch.randn(3, 4, 3, 3)
    w_spec = (S1, R) if spec == (S1, R) else (R, R)
    check(mesh, lambda x, w: F.conv2d(x, w, padding=1), [x, w], [spec, w_spec], grad=(0, 1), atol=1e-4, rtol=1e-4)


def test_batch_sharded_conv_step_moves_only_the_weight_gradient(mesh1d):
    """Forward and input gradient of a batch-sharded conv are local; the weight and bias
    gradients are Partial sums, reduced once each when read."""
    x, w, b = torch.randn(5, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)
    dx = distribute(x, mesh1d, [S0], requires_grad=True)
    dw, db = (distribute(t, mesh1d, [R], requires_grad=True) for t in (w, b))
    with dt.debug.comm_mode() as comm:
        y = F.conv2d(dx, dw, db, padding=1)
        y.sum().backward()
    assert y.placements == (S0,) and dx.grad.placements == (S0,)
    assert comm.counts_by_op().get("aten.convolution.default") is None
    assert comm.counts_by_op().get("aten.convolution_backward.default") is None
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    F.conv2d(xr, wr, br, padding=1).sum().backward()
    assert_close(dx.grad, xr.grad, atol=1e-4, rtol=1e-4)
    assert_close(dw.grad, wr.grad, atol=1e-4, rtol=1e-4)
    assert_close(db.grad, br.grad, atol=1e-4, rtol=1e-4)


GROUP_NORM_CASES = [  # (input shape, groups, input spec)
    ((5, 6, 4, 3), 3, (S0, R)),
    ((3, 4, 5), 2, (R, S0)),            # a batch of 3 on 4 ranks: an empty shard
    ((5, 6, 4, 3), 2, (S0, S1)),        # a channel shard: gathered on that dim
]


@pytest.mark.parametrize("shape,groups,spec", GROUP_NORM_CASES, ids=str)
def test_group_norm(mesh, shape, groups, spec):
    x, w, b = torch.randn(shape), torch.randn(shape[1]), torch.randn(shape[1])
    out = check(mesh, lambda x, w, b: F.group_norm(x, groups, w, b, eps=1e-5), [x, w, b], [spec, (R, R), (R, R)],
                grad=(0, 1, 2), atol=1e-4, rtol=1e-4)
    if mesh.ndim == 1 and spec[0] == S0:
        assert out[0].placements == (S0,)


@pytest.mark.parametrize("spec", [(S0, R), (R, S0), (S0, S1), (P, R)], ids=str)
@pytest.mark.parametrize("size", [None, (7, 5)], ids=["scale2", "size7x5"])
def test_upsample_nearest2d(mesh, spec, size):
    x = torch.randn(5, 3, 4, 3)

    def fn(t):
        if size is None:
            return F.interpolate(t, scale_factor=2.0, mode="nearest")
        return F.interpolate(t, size=size, mode="nearest")

    out = check(mesh, fn, [x], [spec], grad=(0,))
    if spec != (P, R):
        assert out[0].placements == tuple(on_mesh(mesh, spec))    # kept: nothing gathered


def test_group_norm_of_shards_laid_out_unlike_the_global_tensor(mesh1d):
    """The controller's group_norm makes the global input contiguous; each worker's shard can
    still be strided otherwise (here batch-1 shards written channels-last with a batch stride of
    16, as a VAE's convolutions leave them), and the CPU kernel refuses those: the workers'
    group-norm kernel makes its shard contiguous."""
    full = torch.randn(len(mesh1d.ranks), 16, 8, 8)
    # (C, H, W) channels-last, then a batch dim: strides (16, 1, 128, 16)
    shards = {rank: full[i].permute(1, 2, 0).contiguous().permute(2, 0, 1).unsqueeze(0)
              for i, rank in enumerate(mesh1d.ranks)}
    assert all(s.shape == (1, 16, 8, 8) and not s.is_contiguous() for s in shards.values())
    x = dt.from_local(shards, mesh1d, [S0], shape=tuple(full.shape))
    w, b = torch.randn(16), torch.randn(16)
    y = F.group_norm(x, 4, distribute(w, mesh1d, [R]), distribute(b, mesh1d, [R]))
    assert y.placements == (S0,)
    assert_close(y, F.group_norm(full, 4, w, b), atol=1e-5, rtol=1e-5)
