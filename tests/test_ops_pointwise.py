"""Elementwise ops against plain torch: broadcasting, Python scalars, in-place, Partial linearity.

``check_op`` (used by the other ``test_ops_*`` files too) runs one function on torch tensors and
on distributed copies of them, compares forward values and input gradients, and asserts that no
op went through the replicated fallback (strict mode is on, so a missing rule raises).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import dtorch_core as dt
from tests.helpers import assert_close, distribute, placements_for

R = dt.Replicate()
P = dt.Partial("sum")


def S(d):
    return dt.Shard(d)


# ---------------------------------------------------------------------------------------------
# the checker shared by the op test files
# ---------------------------------------------------------------------------------------------
def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def _differentiable(t):
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def distribute_spread(t, mesh, placements, requires_grad=False, seed=0):
    """Like ``helpers.distribute`` but every rank of a Partial mesh dim holds a different part
    of the value, so an op that forgets to reduce a Partial input shows even where
    ``f(0) == 0``: random parts that add up to ``t`` (sum) or average to it (avg); for max/min
    each element's true value sits on one random rank and the others hold smaller/larger ones.
    """
    from dtorch_core.mesh import root_coordinate
    from dtorch_core.spec import shard_region

    root = mesh.root
    full = tuple(placements)
    part_dims = [m for m, p in enumerate(full) if isinstance(p, dt.Partial)]
    if not part_dims:
        return distribute(t, mesh, placements, requires_grad)
    kinds = {full[m].reduce_op for m in part_dims}
    assert mesh.is_root and len(kinds) == 1, "one Partial kind per tensor"
    kind = kinds.pop()
    gen = torch.Generator().manual_seed(seed + 7)
    # one part per coordinate along the Partial mesh dims: replicas along the other mesh dims
    # must hold equal values
    keys = list(itertools.product(*(range(root.shape[m]) for m in part_dims)))
    noise = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k in keys}
    mean = sum(noise.values()) / len(keys)
    owner = torch.randint(len(keys), t.shape, generator=gen)
    parts = {}
    for n, k in enumerate(keys):
        if kind == "sum":
            parts[k] = t / len(keys) + noise[k] - mean
        elif kind == "avg":
            parts[k] = t + noise[k] - mean
        else:
            off = noise[k].abs() * (owner != n)
            parts[k] = t - off if kind == "max" else t + off
    shards = {}
    for rank in root.ranks:
        coord = root_coordinate(root, rank)
        region = shard_region(tuple(t.shape), full, root.shape, coord)
        index = tuple(slice(o, o + n) for o, n in region)
        shards[rank] = parts[tuple(coord[m] for m in part_dims)][index].contiguous()
    x = dt.from_local(shards, mesh, full, shape=tuple(t.shape))
    if requires_grad:
        x.requires_grad_(True)
    return x


def check_op(fn, inputs, placements, mesh, *, grad=True, rtol=1e-4, atol=1e-4, seed=0,
             expect_placements=None, spread=True, backward_fallback=()):
    """Compare ``fn(*inputs)`` on torch with ``fn`` on the inputs distributed with ``placements``.

    ``placements[i]`` is a placement list for input ``i`` or ``None`` to pass it as a plain
    torch tensor. Partial inputs are spread over the ranks (``distribute_spread``) unless
    ``spread`` is False. With ``grad`` every floating input requires grad, the outputs are
    back-propagated with a random cotangent, and the input gradients are compared.
    ``expect_placements``: placements the first output must have (checks that the rule kept a
    shard or a Partial instead of gathering). Strict mode is on: an op without a valid rule
    raises, and no op may have run through the replicated fallback, except the ops named in
    ``backward_fallback`` during the backward pass (ops of families these files do not cover;
    each use names the op so it can go once that family has its rule).
    """
    dt.set_strict(True)
    msg = f"placements={placements}"
    place = distribute_spread if spread else distribute
    ref_in = [t.detach().clone().requires_grad_(grad and _differentiable(t)) for t in inputs]
    dist_in = [
        t.detach().clone() if p is None
        else place(t, mesh, p, requires_grad=grad and _differentiable(t))
        for t, p in zip(inputs, placements)
    ]
    ref_out = _flat(fn(*ref_in))
    out = fn(*dist_in)
    dist_out = _flat(out)
    assert len(dist_out) == len(ref_out), msg
    for o, r in zip(dist_out, ref_out):
        assert isinstance(o, dt.DTensor), f"{msg}: output is {type(o).__name__}, not a DTensor"
        assert o.shape == r.shape and o.dtype == r.dtype, f"{msg}: {o} vs {r.shape} {r.dtype}"
        assert_close(o.full_tensor(), r.detach(), rtol=rtol, atol=atol, msg=msg)
    if expect_placements is not None:
        assert tuple(dist_out[0].placements) == tuple(expect_placements), f"{msg}: got {dist_out[0].placements}"
    if grad:
        pairs = [(o, r) for o, r in zip(dist_out, ref_out) if r.requires_grad]
        assert pairs, f"{msg}: no differentiable output"
        gen = torch.Generator().manual_seed(seed + 1)
        cots = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for _, r in pairs]
        torch.autograd.backward([r for _, r in pairs], cots)
        if backward_fallback:
            dt.set_strict(False)
        torch.autograd.backward([o for o, _ in pairs],
                                [dt.distribute_tensor(c, mesh, [R] * mesh.ndim) for c in cots])
        fallen = set(dt.fallback_counts())
        assert fallen <= set(backward_fallback), f"{msg}: fallback in backward {fallen}"
        dt.set_strict(True)
        n = 0
        for x, r in zip(dist_in, ref_in):
            if r.requires_grad and isinstance(x, dt.DTensor):
                if r.grad is None:  # not an input of the differentiable part (e.g. a mask)
                    assert x.grad is None, msg
                    continue
                assert x.grad is not None, f"{msg}: no gradient"
                assert_close(x.grad.full_tensor(), r.grad, rtol=rtol, atol=atol, msg=f"{msg} (grad)")
                n += 1
        assert n, f"{msg}: no gradient compared"
    assert set(dt.fallback_counts()) <= set(backward_fallback), f"{msg}: fallback {dt.fallback_counts()}"
    return out


def sample_placements(inputs, mesh, k, *, seed=0, partial=True):
    """Up to ``k`` placement combinations (one placement list per input), sampled with a fixed
    seed from every Replicate/Shard(d)/Partial choice per input (all-Replicate left out);
    inputs that are not floating never get Partial."""
    per_input = [placements_for(t, mesh, partial=partial and _differentiable(t)) for t in inputs]
    # every input replicated exercises nothing distributed
    combos = [c for c in itertools.product(*per_input) if any(p != R for pl in c for p in pl)]
    if len(combos) <= k:
        return combos
    return random.Random(seed).sample(combos, k)


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
