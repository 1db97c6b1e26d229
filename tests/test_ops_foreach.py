"""``_foreach_*`` ops (what torch.optim uses), clip_grad_norm_ and foreach optimizers on lists of
distributed tensors with mixed, uneven placements, against the same calls on plain tensors.
Strict mode is on: every element runs through its single-tensor rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dtorch_core as dt

from .helpers import assert_close, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1 = dt.Shard(0), dt.Shard(1)
SHAPES = [(10, 7), (5,), (3, 6)]
SPECS = [(S0, R), (R, S0), (S1, S0)]


@pytest.fixture(autouse=True)
def strict(runner):
    dt.set_strict(True)


def _lists(n, seed, positive=False, specs=SPECS):
    gen = torch.Generator().manual_seed(seed)
    plain = []
    for _ in range(n):
        ts = [torch.randn(s, generator=gen) for s in SHAPES]
        plain.append([t.abs() + 0.1 if positive else t for t in ts])
    return plain


def _distribute_lists(mesh, plain, specs=SPECS):
    return [[distribute(t, mesh, on_mesh(mesh, s)) for t, s in zip(ts, specs)] for ts in plain]


# each case: (number of tensor lists, positive inputs, fn(lists) -> result or None for in-place)
SCALAR_T = torch.tensor(0.75)
CASES = {
    "add_.List": (2, False, lambda a, b: torch._foreach_add_(a, b, alpha=-0.5)),
    "add_.Scalar": (1, False, lambda a: torch._foreach_add_(a, 2.0)),
    "add_.ScalarList": (1, False, lambda a: torch._foreach_add_(a, [1.0, -2.0, 3.0])),
    "add_.Tensor": (1, False, lambda a: torch._foreach_add_(a, SCALAR_T, alpha=2.0)),
    "add.List": (2, False, lambda a, b: torch._foreach_add(a, b)),
    "mul_.Scalar": (1, False, lambda a: torch._foreach_mul_(a, 0.9)),
    "mul_.List": (2, False, lambda a, b: torch._foreach_mul_(a, b)),
    "mul_.Tensor": (1, False, lambda a: torch._foreach_mul_(a, SCALAR_T)),
    "mul_.ScalarList": (1, False, lambda a: torch._foreach_mul_(a, [0.5, 2.0, -1.0])),
    "addcmul_.Scalar": (3, False, lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.1)),
    "addcmul_.ScalarList": (3, False, lambda a, b, c: torch._foreach_addcmul_(a, b, c, [0.1, 0.2, 0.3])),
    "addcmul_.Tensor": (3, False, lambda a, b, c: torch._foreach_addcmul_(a, b, c, torch.tensor([0.1, -1.0, 2.0]))),
    "addcdiv_.Scalar": (3, True, lambda a, b, c: torch._foreach_addcdiv_(a, b, c, value=-0.3)),
    "addcdiv_.ScalarList": (3, True, lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [-0.1, 0.2, 1.5])),
    "addcdiv_.Tensor": (3, True, lambda a, b, c: torch._foreach_addcdiv_(a, b, c, torch.tensor([0.1, 0.2, 0.3]))),
    "lerp_.Scalar": (2, False, lambda a, b: torch._foreach_lerp_(a, b, 0.1)),
    "lerp_.List": (3, False, lambda a, b, c: torch._foreach_lerp_(a, b, c)),
    "lerp_.ScalarList": (2, False, lambda a, b: torch._foreach_lerp_(a, b, [0.1, 0.5, 0.9])),
    "sqrt": (1, True, lambda a: torch._foreach_sqrt(a)),
    "sqrt_": (1, True, lambda a: torch._foreach_sqrt_(a)),
    "norm": (1, False, lambda a: torch._foreach_norm(a)),
    "norm.inf": (1, False, lambda a: torch._foreach_norm(a, float("inf"))),
    "norm.1.f64": (1, False, lambda a: torch._foreach_norm(a, 1, dtype=torch.float64)),
    "maximum_.List": (2, False, lambda a, b: torch._foreach_maximum_(a, b)),
    "maximum_.Scalar": (1, False, lambda a: torch._foreach_maximum_(a, 0.2)),
    "maximum_.ScalarList": (1, False, lambda a: torch._foreach_maximum_(a, [0.0, -0.5, 0.5])),
    "maximum.List": (2, False, lambda a, b: torch._foreach_maximum(a, b)),
    "minimum_.List": (2, False, lambda a, b: torch._foreach_minimum_(a, b)),
    "div_.List": (2, True, lambda a, b: torch._foreach_div_(a, b)),
    "sub_.Scalar": (1, False, lambda a: torch._foreach_sub_(a, 1.5)),
    "neg": (1, False, lambda a: torch._foreach_neg(a)),
    "zero_": (1, False, lambda a: torch._foreach_zero_(a)),
    "copy_": (2, False, lambda a, b: torch._foreach_copy_(a, b)),
    "pow.ScalarAndTensor": (1, False, lambda a: torch._foreach_pow(0.9, a)),
    "clamp_min_.Scalar": (1, False, lambda a: torch._foreach_clamp_min_(a, 0.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_foreach_op(mesh, name):
    n, positive, fn = CASES[name]
    plain = _lists(n, seed=len(name), positive=positive)
    dist = _distribute_lists(mesh, plain)
    ref_lists = [[t.clone() for t in ts] for ts in plain]
    got, expected = fn(*dist), fn(*ref_lists)
    if name.split(".")[0].endswith("_"):  # in place: every list the op writes matches torch's
        for d_list, r_list in zip(dist, ref_lists):
            for d, r in zip(d_list, r_list):
                assert_close(d, r)
    else:
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert isinstance(g, dt.DTensor) and g.dtype == e.dtype
            assert_close(g, e)
        for d_list, p_list in zip(dist, plain):  # out of place: the inputs are untouched
            for d, p in zip(d_list, p_list):
                assert_close(d, p)
    assert dt.fallback_counts() == {}


def test_foreach_on_partial_inputs(mesh):
    specs = [(P, R), (P, S0), (S1, P)]
    plain = _lists(2, seed=3)
    a, b = _distribute_lists(mesh, plain, specs)
    torch._foreach_add_(a, b, alpha=2.0)
    torch._foreach_mul_(a, 0.5)
    norms = torch._foreach_norm(a)
    ref = [(x + 2 * y) * 0.5 for x, y in zip(*plain)]
    for d, r, nrm in zip(a, ref, norms):
        assert_close(d, r)
        assert_close(nrm, torch.linalg.vector_norm(r))


@pytest.mark.parametrize("name", ["sqrt", "add.List", "norm"])
def test_foreach_backward(mesh, name):
    n, _, fn = CASES[name]
    plain = [[t.requires_grad_() for t in ts] for ts in _lists(n, seed=9, positive=True)]
    dist = [[distribute(t, mesh, on_mesh(mesh, s), requires_grad=True) for t, s in zip(ts, SPECS)] for ts in plain]
    out, ref = fn(*dist), fn(*plain)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(r.shape, generator=gen) for r in ref]
    sum((o.full_tensor() * w).sum() for o, w in zip(out, weights)).backward()
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    for d_list, p_list in zip(dist, plain):
        for d, p in zip(d_list, p_list):
            assert_close(d.grad, p.grad)


# ---------------------------------------------------------------------------------------------
# clip_grad_norm_
# ---------------------------------------------------------------------------------------------
def _params_with_grads(mesh, scale):
    gen = torch.Generator().manual_seed(1)
    plain = [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) * scale for s in SHAPES]
    dist = []
    for p, g, spec, gspec in zip(plain, grads, SPECS, [(S0, R), (R, S0), (S1, P)]):
        p.grad = g.clone()
        d = nn.Parameter(distribute(p.detach(), mesh, on_mesh(mesh, spec)))
        # a gradient placed as backward may leave it (a Partial sum included)
        d.grad = distribute(g, mesh, on_mesh(mesh, gspec))
        dist.append(d)
    return plain, dist


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("scale", [1.0, 0.01])  # clipped / left alone
def test_clip_grad_norm(mesh, norm_type, foreach, scale):
    plain, dist = _params_with_grads(mesh, scale)
    ref_total = nn.utils.clip_grad_norm_(plain, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    total = nn.utils.clip_grad_norm_(dist, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    assert isinstance(total, dt.DTensor)
    assert_close(total, ref_total)
    for d, p in zip(dist, plain):
        assert_close(d.grad, p.grad)
    assert dt.fallback_counts() == {}


def test_clip_grad_norm_error_if_nonfinite(mesh):
    plain, dist = _params_with_grads(mesh, 1.0)
    total = nn.utils.clip_grad_norm_(dist, 0.5, error_if_nonfinite=True)
    assert_close(total, nn.utils.clip_grad_norm_(plain, 0.5))
    dist[1].grad.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_(dist, 0.5, error_if_nonfinite=True)


# ---------------------------------------------------------------------------------------------
# foreach optimizers (the same _foreach_* calls, issued by torch.optim)
# ---------------------------------------------------------------------------------------------
OPTIMIZERS = {
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_optimizer_steps(mesh, name):
    plain, dist = _params_with_grads(mesh, 1.0)
    opt, ref_opt = OPTIMIZERS[name](dist), OPTIMIZERS[name](plain)
    for step in range(3):
        opt.step()
        ref_opt.step()
        for d, p in zip(dist, plain):
            d.grad.mul_(0.5)  # a new gradient each step, placements unchanged
            p.grad.mul_(0.5)
    for d, p in zip(dist, plain):
        assert_close(d, p.detach(), atol=1e-5, rtol=1e-4)
    assert dt.fallback_counts() == {}
