"""``_foreach_*`` ops (what torch.optim uses), clip_grad_norm_ and foreach optimizers on lists of
distributed tensors with mixed, uneven placements, against the same calls on plain tensors.
Strict mode is on (nothing falls back). A foreach call is one worker call of the aten foreach op
whatever the list length (recorded instructions are counted), ``_foreach_norm`` a fixed handful;
what the foreach rule cannot serve still runs element by element."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call, Collective, DefinePlan
from dtorch_core.redistribute import plan_redistribute

from .helpers import DEVICE, WORLD_SIZE, assert_close, distribute, on_mesh

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
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_optimizer_steps(mesh, name):
    plain, dist = _params_with_grads(mesh, 1.0)
    opt, ref_opt = OPTIMIZERS[name](dist), OPTIMIZERS[name](plain)
    for step in range(4):
        if step == 2:  # state exists by now: one worker call per foreach call, none per element
            with current_session().recording() as rec:
                opt.step()
            targets = _call_targets(rec)
            assert sum(t.startswith("aten::_foreach_") for t in targets) >= 3, targets
            # what is not a foreach call works on a scalar (AdamW's lr * weight_decay), once
            assert all(targets.count(t) == 1 for t in targets if not t.startswith("aten::_foreach_")), targets
        else:
            opt.step()
        ref_opt.step()
        for d, p in zip(dist, plain):
            d.grad.mul_(0.5)  # a new gradient each step, placements unchanged
            p.grad.mul_(0.5)
    for d, p in zip(dist, plain):
        assert_close(d, p.detach(), atol=1e-5, rtol=1e-4)
    assert dt.fallback_counts() == {}


# ---------------------------------------------------------------------------------------------
# one worker call per foreach call
# ---------------------------------------------------------------------------------------------
MIXED = [(S0, R), (R, S1), (R, R), (S1, S0)]  # a colwise, a rowwise, a replicated, a 2-D weight


def _mixed_lists(mesh, n, n_lists, specs=MIXED, seed=0):
    """``n_lists`` lists of ``n`` tensors of uneven shapes; element k of every list has the
    shape and the placements ``specs[k % len(specs)]`` unless ``specs`` is a list of lists."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5 + k % 4, 3 + k % 3) for k in range(n)]
    plain = [[torch.randn(s, generator=gen).abs() + 0.1 for s in shapes] for _ in range(n_lists)]
    per_list = specs if isinstance(specs[0], list) else [specs] * n_lists
    dist = [[distribute(t, mesh, on_mesh(mesh, sp[k % len(sp)])) for k, t in enumerate(ts)]
            for ts, sp in zip(plain, per_list)]
    return plain, dist


def _call_targets(rec):
    session = current_session()
    return [session.plan_names[i.plan_id].target for i in rec.instructions if type(i) is Call]


def _count(rec, kind):
    return sum(type(i) is kind for i in rec.instructions)


@pytest.mark.parametrize("n", [3, 40])
def test_foreach_is_one_call(mesh, n):
    (pa, pb), (a, b) = _mixed_lists(mesh, n, 2)
    torch._foreach_add_(a, b, alpha=0.5)  # plans it
    torch._foreach_add_(pa, pb, alpha=0.5)
    with current_session().recording() as rec:
        torch._foreach_add_(a, b, alpha=0.5)
        out = torch._foreach_mul(a, 2.0)
    torch._foreach_add_(pa, pb, alpha=0.5)
    assert _call_targets(rec) == ["aten::_foreach_add_.List", "aten::_foreach_mul.Scalar"]
    assert _count(rec, Collective) == 0  # the lists share placements: nothing moves
    for d, p, o in zip(a, pa, out):
        assert_close(d, p)
        assert_close(o, p * 2.0)
        assert o.placements == d.placements
    assert dt.fallback_counts() == {}


@pytest.mark.parametrize("n", [3, 40])
def test_foreach_moves_only_what_differs(mesh, n):
    # list b places element k as list a places element k + 1: b's elements move to a's placements
    specs_b = MIXED[1:] + MIXED[:1]
    (pa, pb), (a, b) = _mixed_lists(mesh, n, 2, specs=[MIXED, specs_b])
    for k in range(n):  # the shapes must agree per position: give b a's shapes where they differ
        if pb[k].shape != pa[k].shape:
            pb[k] = torch.randn(pa[k].shape) + 2.0
            b[k] = distribute(pb[k], mesh, on_mesh(mesh, specs_b[k % len(MIXED)]))
    expected_moves = sum(len(plan_redistribute(y.placements, x.placements)) for x, y in zip(a, b))
    with current_session().recording() as rec:
        torch._foreach_mul_(a, b)
    torch._foreach_mul_(pa, pb)
    assert _call_targets(rec) == ["aten::_foreach_mul_.List"]
    assert _count(rec, Collective) == expected_moves
    for d, p, placements in zip(a, pa, [on_mesh(mesh, MIXED[k % len(MIXED)]) for k in range(n)]):
        assert list(d.placements) == placements  # the written list keeps its placements
        assert_close(d, p)


def test_foreach_new_numbers_are_not_planned_again(mesh):
    (pa, pb, pc), (a, b, c) = _mixed_lists(mesh, 12, 3)
    for step in range(3):
        values = [0.1 * (step + 1) + k for k in range(12)]  # Adam's step_size changes every step
        with current_session().recording() as rec:
            torch._foreach_addcdiv_(a, b, c, values)
        torch._foreach_addcdiv_(pa, pb, pc, values)
        assert _call_targets(rec) == ["aten::_foreach_addcdiv_.ScalarList"]
        if step:  # the numbers travel with each Call: one worker definition serves every step
            assert _count(rec, DefinePlan) == 0
            assert [i.numbers for i in rec.instructions if type(i) is Call] == [tuple(values)]
    for d, p in zip(a, pa):
        assert_close(d, p)


def test_eager_adam_steps_do_not_grow_the_plan_tables(mesh1d):
    # a non-capturable Adam sends new step sizes every step: they travel with the Calls, so
    # after the first steps nothing new is defined on the workers
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    dt.nn.parallelize_module(model, mesh1d, {"0": dt.nn.ColwiseParallel(), "2": dt.nn.RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    session = current_session()
    x = distribute(torch.randn(5, 6), mesh1d, [R])
    sizes = []
    for step in range(40):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sizes.append(len(session.plan_names))
    assert sizes[-1] == sizes[19], sizes


@pytest.mark.parametrize("n", [3, 40])
def test_foreach_norm_is_a_fixed_handful(mesh, n):
    (pa,), (a,) = _mixed_lists(mesh, n, 1)
    for ord_ in (2.0, float("inf")):
        torch._foreach_norm(a, ord_)
        with current_session().recording() as rec:
            norms = torch._foreach_norm(a, ord_)
        assert _call_targets(rec) == ["dtorch::foreach_powsum", "dtorch::foreach_norm_root"]
        assert _count(rec, Collective) <= mesh.ndim
        for got, p in zip(norms, pa):
            assert got.placements == (R,) * mesh.ndim
            assert_close(got, torch.linalg.vector_norm(p, ord_))


@pytest.mark.parametrize("ord_", [2, 1, 3.5, 0, float("inf")])
@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_foreach_norm_uneven_and_empty_shards(mesh, ord_, dtype):
    gen = torch.Generator().manual_seed(5)
    # fewer rows or columns than workers: some shards are uneven, some empty; a global empty one
    shapes = [(1, 3), (WORLD_SIZE + 1, 2) if WORLD_SIZE < 2 else (WORLD_SIZE - 1, 2), (WORLD_SIZE + 1,), (2, WORLD_SIZE + 2), (0, 3), ()]
    specs = [(S0, R), (S0, S1), (S0, R), (S1, S0), (S0, R), (R, R)]
    plain = [torch.randn(s, generator=gen) for s in shapes]
    plain[1][0, 0] = 0.0  # a zero counts for nothing in the 0-norm
    if ord_ == float("inf"):  # torch refuses the inf norm of an empty tensor: leave it out
        plain, specs = plain[:4] + plain[5:], specs[:4] + specs[5:]
    dist = [distribute(t, mesh, on_mesh(mesh, s)) for t, s in zip(plain, specs)]
    got = torch._foreach_norm(dist, ord_, dtype=dtype)
    expected = torch._foreach_norm(plain, ord_, dtype=dtype)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert dt.fallback_counts() == {}


@pytest.mark.parametrize("n", [3, 12])
def test_clip_grad_norm_foreach_instructions_do_not_grow(mesh, n):
    gen = torch.Generator().manual_seed(2)
    grad_specs = [(S0, R), (R, S1), (R, R), (S1, P)]
    plain, dist = [], []
    for k in range(n):
        p = nn.Parameter(torch.randn(5 + k % 4, 3 + k % 3, generator=gen))
        p.grad = torch.randn(p.shape, generator=gen)
        plain.append(p)
        d = nn.Parameter(distribute(p.detach(), mesh, on_mesh(mesh, MIXED[k % 4])))
        d.grad = distribute(p.grad, mesh, on_mesh(mesh, grad_specs[k % 4]))
        dist.append(d)
    nn.utils.clip_grad_norm_(dist, 0.5, foreach=True)
    nn.utils.clip_grad_norm_(plain, 0.5, foreach=True)
    with current_session().recording() as rec:
        total = nn.utils.clip_grad_norm_(dist, 0.5, foreach=True)
    ref = nn.utils.clip_grad_norm_(plain, 0.5, foreach=True)
    # the norms, their stack and norm, the clip factor and the one _foreach_mul_
    assert len(_call_targets(rec)) <= 10, _call_targets(rec)
    assert "aten::_foreach_mul_.Tensor" in _call_targets(rec)
    assert_close(total, ref)
    for d, p in zip(dist, plain):
        assert_close(d.grad, p.grad)
    assert dt.fallback_counts() == {}


# ---------------------------------------------------------------------------------------------
# what the rule does not serve runs element by element, as before
# ---------------------------------------------------------------------------------------------
def test_foreach_lists_on_different_meshes(runner):
    m1 = dt.init_device_mesh(DEVICE, (WORLD_SIZE,), mesh_dim_names=("x",))
    m2 = dt.init_device_mesh(DEVICE, (1, WORLD_SIZE), mesh_dim_names=("a", "b"))
    gen = torch.Generator().manual_seed(3)
    pa = [torch.randn(6, 3, generator=gen), torch.randn(5, generator=gen)]
    pb = [torch.randn(6, 3, generator=gen), torch.randn(5, generator=gen)]
    a = [distribute(pa[0], m1, [S0]), distribute(pa[1], m2, [R, S0])]
    b = [distribute(pb[0], m1, [R]), distribute(pb[1], m2, [R, R])]
    torch._foreach_add_(a, b, alpha=3.0)
    norms = torch._foreach_norm(a)
    for d, x, y, nrm in zip(a, pa, pb, norms):
        assert_close(d, x + 3.0 * y)
        assert_close(nrm, torch.linalg.vector_norm(x + 3.0 * y))
    assert dt.fallback_counts() == {}


def test_foreach_scalars_given_as_a_dtensor(mesh):
    (pa, pb, pc), (a, b, c) = _mixed_lists(mesh, 4, 3)
    scalars = torch.tensor([0.5, -1.0, 2.0, 0.25])
    torch._foreach_addcmul_(a, b, c, distribute(scalars, mesh, [R] * mesh.ndim))
    torch._foreach_addcmul_(pa, pb, pc, scalars)
    for d, p in zip(a, pa):
        assert_close(d, p)
