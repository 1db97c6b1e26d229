"""Elementwise ops against plain torch: broadcasting, Python scalars, in-place, Partial linearity.

``check_op`` (in ``helpers``, used by the other ``test_ops_*`` files too) runs one function on torch tensors and
on distributed copies of them, compares forward values and input gradients, and asserts that no
op went through the replicated fallback (strict mode is on, so a missing rule raises).
"""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import P, R, S, assert_close, check_op, distribute_spread, sample_placements


# ---------------------------------------------------------------------------------------------
# unary
# ---------------------------------------------------------------------------------------------
UNARY = {
    "neg": torch.neg,
    "exp": torch.exp,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "pow_scalar": lambda x: x ** 2,
    "pow_scalar_base": lambda x: 2.0 ** x,
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7),
    "clamp_min": lambda x: x.clamp(min=0.1),
    "add_scalar": lambda x: x + 2.5,
    "rsub_scalar": lambda x: 1.5 - x,
    "mul_scalar": lambda x: 3 * x,
    "div_scalar": lambda x: x / 4,
    "rdiv_scalar": lambda x: 2 / (x.abs() + 1),
    "sub_alpha_self": lambda x: torch.sub(x, x, alpha=0.5),
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "hardtanh": lambda x: torch.nn.functional.hardtanh(x, -0.5, 0.5),
    "leaky_relu": lambda x: torch.nn.functional.leaky_relu(x, 0.1),
    "elu": torch.nn.functional.elu,
    "softplus": lambda x: torch.nn.functional.softplus(x, beta=2),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(mesh, name):
    t = torch.randn(10, 7)
    for pl in sample_placements([t], mesh, 3, seed=len(name)):
        check_op(UNARY[name], [t], pl, mesh)


@pytest.mark.parametrize("shape", [(10, 7), (3, 5, 2), (7,)])
def test_unary_keeps_shard(mesh, shape):
    """A shard of any dim, uneven included, stays a shard: nothing is gathered."""
    t = torch.randn(shape)
    for d in range(len(shape)):
        pl = [S(d)] + [R] * (mesh.ndim - 1)
        check_op(torch.nn.functional.gelu, [t], [pl], mesh, expect_placements=pl)


# ---------------------------------------------------------------------------------------------
# binary and ternary with broadcasting
# ---------------------------------------------------------------------------------------------
BINARY = {
    "add": torch.add,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=-2),
    "sub": torch.sub,
    "mul": torch.mul,
    "div": lambda a, b: a / (b.abs() + 0.5),
    "pow": lambda a, b: torch.pow(a.abs() + 0.1, b),
    "maximum": torch.maximum,
    "lerp_scalar": lambda a, b: torch.lerp(a, b, 0.3),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "rsub": lambda a, b: torch.rsub(a, b, alpha=3),
    "remainder": lambda a, b: torch.remainder(a, b.abs() + 0.5),
}
# elementwise ops without a derivative: forward only
BINARY_NO_GRAD = {
    "floor_divide": lambda a, b: a // (b.abs() + 0.5),
    "floor_divide_scalar": lambda a, b: (a - b) // 0.3,
    "eq_and_lt": lambda a, b: (a.round() == b.round()) | (a < b),
    "int_ops": lambda a, b: (a * 4).int() * 3 - (b * 4).int() // 2,
}
SHAPES = {
    "same": ((10, 7), (10, 7)),
    "row": ((10, 7), (7,)),
    "col": ((10, 1), (1, 7)),
    "3d": ((3, 1, 5), (7, 1)),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(mesh, name):
    for k, shapes in enumerate(sorted(SHAPES)):
        a, b = (torch.randn(s) for s in SHAPES[shapes])
        for pl in sample_placements([a, b], mesh, 2, seed=k + len(name)):
            check_op(BINARY[name], [a, b], pl, mesh)


@pytest.mark.parametrize("name", sorted(BINARY_NO_GRAD))
def test_binary_no_grad(mesh, name):
    a, b = torch.randn(10, 7), torch.randn(7)
    for pl in sample_placements([a, b], mesh, 4, seed=len(name)):
        check_op(BINARY_NO_GRAD[name], [a, b], pl, mesh, grad=False)


TERNARY = {
    "addcmul": lambda x, a, b: torch.addcmul(x, a, b, value=0.5),
    "addcdiv": lambda x, a, b: torch.addcdiv(x, a, b.abs() + 1, value=-2),
    "lerp_tensor": lambda x, a, w: torch.lerp(x, a, torch.sigmoid(w)),
    "clamp_tensor": lambda x, lo, hi: torch.clamp(x, lo, lo + hi.abs()),
    "where": lambda x, a, b: torch.where(x > 0, a, b),
}


@pytest.mark.parametrize("name", sorted(TERNARY))
def test_ternary_broadcast(mesh, name):
    x, a, b = torch.randn(10, 1, 3), torch.randn(7, 1), torch.randn(3)
    for pl in sample_placements([x, a, b], mesh, 5, seed=len(name)):
        check_op(TERNARY[name], [x, a, b], pl, mesh)


def test_masked_fill(mesh):
    x = torch.randn(10, 7)
    mask = torch.randn(10, 7) > 0
    row_mask = torch.randn(7) > 0
    for m in (mask, row_mask):
        for pl in sample_placements([x, m], mesh, 4, seed=m.ndim):
            check_op(lambda a, k: a.masked_fill(k, -1.5), [x, m], pl, mesh)
            check_op(lambda a, k: torch.where(k, a, 0.25), [x, m], pl, mesh)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_plain_tensor_is_replicated(mesh, op):
    """A plain torch.Tensor meeting a DTensor acts as replicated (DESIGN 6)."""
    a, b = torch.randn(10, 7), torch.randn(7)
    fn = getattr(torch, op)
    for pl in ([S(0)] * mesh.ndim, [S(1)] + [R] * (mesh.ndim - 1), [P] * mesh.ndim):
        check_op(fn, [a, b], [pl, None], mesh)


# ---------------------------------------------------------------------------------------------
# in-place
# ---------------------------------------------------------------------------------------------
INPLACE = {
    "add_": lambda x, y: x.add_(y),
    "add_scalar_": lambda x, y: x.add_(1.5).mul_(y),
    "sub_alpha_": lambda x, y: x.sub_(y, alpha=3),
    "mul_": lambda x, y: x.mul_(y),
    "div_": lambda x, y: x.div_(y.abs() + 1),
    "clamp_": lambda x, y: x.add_(y).clamp_(-0.5, 0.5),
    "relu_": lambda x, y: x.mul_(y).relu_(),
    "masked_fill_": lambda x, y: x.masked_fill_(y > 0, 0.0),
}
# linear in the mutated tensor: a Partial one stays Partial
LINEAR_INPLACE = {"add_", "sub_alpha_", "mul_", "div_", "masked_fill_"}


@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace(mesh, name):
    """In-place ops keep the mutated tensor's placement (uneven shards included); a Partial
    one stays Partial where the op is linear in it and is reduced (its handle rebound) where
    it is not."""
    x, y = torch.randn(10, 7), torch.randn(7)

    def fn(a, b):
        a = a * 1.0 if a.requires_grad else a  # a leaf cannot be modified in place
        out = INPLACE[name](a, b)
        assert out is a
        return out

    xps = [[S(0)] * mesh.ndim, [R, S(1)][: mesh.ndim], [S(1)] + [S(0)] * (mesh.ndim - 1)]
    xps.append([P] * mesh.ndim)
    for xp in xps:
        for yp in ([R] * mesh.ndim, [S(0)] * mesh.ndim):
            out = check_op(fn, [x, y], [xp, yp], mesh)
            if name in LINEAR_INPLACE or P not in xp:
                assert tuple(out.placements) == tuple(xp)


def test_inplace_without_grad_updates_tensor(mesh):
    x, y = torch.randn(7, 3), torch.randn(7, 3)
    for xp, yp in (([S(0)] * mesh.ndim, [S(1)] * mesh.ndim), ([P] * mesh.ndim, [P] * mesh.ndim)):
        dt.set_strict(True)
        a, b = distribute_spread(x, mesh, xp), distribute_spread(y, mesh, yp)
        a.add_(b, alpha=2)
        a.mul_(3)
        assert tuple(a.placements) == tuple(xp)
        assert_close(a.full_tensor(), (x + 2 * y) * 3)
        assert dt.fallback_counts() == {}


# ---------------------------------------------------------------------------------------------
# Partial linearity
# ---------------------------------------------------------------------------------------------
LINEAR_CASES = {
    # name: (fn, which inputs are Partial (the others are Replicate))
    "add": (torch.add, "PP"),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=2), "PP"),
    "neg": (lambda a, b: torch.neg(a), "PR"),
    "mul_scalar": (lambda a, b: a * 3, "PR"),
    "div_scalar": (lambda a, b: a / 3, "PR"),
    "mul_replicate": (torch.mul, "PR"),
    "replicate_mul": (torch.mul, "RP"),
    "div_by_replicate": (lambda a, b: a / (b.abs() + 1), "PR"),
    "where_zero": (lambda a, b: torch.where(b > 0, a, torch.zeros(())), "PR"),
}


@pytest.mark.parametrize("name", sorted(LINEAR_CASES))
def test_partial_stays_partial(mesh, name):
    """Linear ops keep Partial(sum) inputs Partial: no reduction is issued."""
    fn, kinds = LINEAR_CASES[name]
    a, b = torch.randn(10, 7), torch.randn(7)
    pl = [[P if k == "P" else R] * mesh.ndim for k in kinds]
    check_op(fn, [a, b], pl, mesh, expect_placements=[P] * mesh.ndim)


NONLINEAR_OF_PARTIAL = {
    "relu": lambda a: torch.relu(a),
    "add_scalar": lambda a: a + 1,
    "sub_scalar": lambda a: a - 1,
    "rsub_scalar": lambda a: 1 - a,
    "exp": torch.exp,
    "pow": lambda a: a ** 2,
    "abs": torch.abs,
    "floor_div": lambda a: torch.div(a, 0.7, rounding_mode="floor"),
    "trunc_div": lambda a: torch.div(a, 0.7, rounding_mode="trunc"),
    "mul_self": lambda a: a * a,
    "to_int": lambda a: a.mul(3).to(torch.int64),
    "to_half_int": lambda a: a.mul(3).to(torch.int32),
    "gt": lambda a: a > 0,
    "clamp": lambda a: a.clamp(-0.2, 0.2),
}


@pytest.mark.parametrize("name", sorted(NONLINEAR_OF_PARTIAL))
def test_nonlinear_of_partial_reduces_first(mesh, name):
    """Ops that are not linear must see the reduced value of a Partial input (spread over
    every rank, so forgetting the reduction shows even where f(0) == 0)."""
    t = torch.randn(10, 7)
    grad = name not in ("to_int", "to_half_int", "gt", "floor_div", "trunc_div")
    for pl in ([P] * mesh.ndim, [P] + [S(0)] * (mesh.ndim - 1), [S(1)] + [P] * (mesh.ndim - 1)):
        check_op(NONLINEAR_OF_PARTIAL[name], [t], [pl], mesh, grad=grad)


# Partial(avg/max/min): linear ops keep avg, value-preserving ops keep every kind, and anything
# else sees the reduced value. ``None``: the result must be right, whatever its placement.
PARTIAL_KINDS = [
    ("clone_max", lambda a: a.clone(), "max", "max"),
    ("to_f64_min", lambda a: a.to(torch.float64), "min", "min"),
    ("to_int_max", lambda a: a.mul(4).round().to(torch.int64), "max", None),
    ("add_avg", lambda a: a + a, "avg", "avg"),
    ("mul_scalar_avg", lambda a: a * 3, "avg", "avg"),
    ("neg_avg", torch.neg, "avg", "avg"),
    ("neg_max", torch.neg, "max", None),
    ("mul_negative_min", lambda a: a * -2, "min", None),
    ("sub_max", lambda a: a - a.detach().clone(), "max", None),
    ("add_scalar_avg", lambda a: a + 1, "avg", None),
    ("relu_max", torch.relu, "max", None),
    ("exp_avg", torch.exp, "avg", None),
    ("where_min", lambda a: torch.where(a > 0, a, -a), "min", None),
]


@pytest.mark.parametrize("case", PARTIAL_KINDS, ids=[c[0] for c in PARTIAL_KINDS])
def test_partial_kinds(mesh, case):
    name, fn, kind, kept = case
    t = torch.randn(10, 7)
    choices = [[dt.Partial(kind)] * mesh.ndim] + ([[dt.Partial(kind), S(0)]] if mesh.ndim == 2 else [])
    for pl in choices:
        expect = None if kept is None else [dt.Partial(kept) if isinstance(p, dt.Partial) else p for p in pl]
        check_op(fn, [t], [pl], mesh, grad=name != "to_int_max", expect_placements=expect)
