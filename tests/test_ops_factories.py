"""Factories and copies against plain torch: dt.zeros/ones/full/empty/arange with placements,
``*_like`` and ``new_*`` on distributed tensors, copy_/fill_/zero_/clone/detach/.to(dtype).
(rand/randn are in test_random.py.) Strict mode is on: none of these may fall back."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import assert_close, check, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1, S2 = dt.Shard(0), dt.Shard(1), dt.Shard(2)
PMAX, PAVG = dt.Partial("max"), dt.Partial("avg")
SPECS = [(R, R), (S0, R), (S1, S0), (S2, S2), (P, S1), (PMAX, R), (S0, PAVG)]


@pytest.fixture(autouse=True)
def strict(runner):
    dt.set_strict(True)


def _check_layout(t, mesh, spec, shape, dtype):
    assert isinstance(t, dt.DTensor)
    assert t.shape == shape and t.dtype == dtype
    assert t.placements == tuple(on_mesh(mesh, spec))
    # every rank holds the shard distribute_tensor would give it
    ref = dt.distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, on_mesh(mesh, spec))
    expected = {r: s.shape for r, s in ref.local_shards().items()}
    assert {r: s.shape for r, s in t.local_shards().items()} == expected


# ---------------------------------------------------------------------------------------------
# dt.zeros / ones / full / empty / arange
# ---------------------------------------------------------------------------------------------
FACTORIES = {
    "zeros": (lambda shape, **kw: dt.zeros(*shape, **kw), lambda shape, dtype: torch.zeros(shape, dtype=dtype)),
    "ones": (lambda shape, **kw: dt.ones(shape, **kw), lambda shape, dtype: torch.ones(shape, dtype=dtype)),
    "full": (lambda shape, **kw: dt.full(shape, 2.5, **kw), lambda shape, dtype: torch.full(shape, 2.5, dtype=dtype)),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_factories(mesh, name, spec, dtype):
    make, ref = FACTORIES[name]
    shape = (10, 7, 3)
    t = make(shape, device_mesh=mesh, placements=on_mesh(mesh, spec), dtype=dtype)
    _check_layout(t, mesh, spec, shape, dtype)
    assert_close(t.full_tensor(), ref(shape, dtype))
    assert dt.fallback_counts() == {}


@pytest.mark.parametrize("spec", [(R, R), (S0, R), (S0, S0), (P, R)], ids=str)
@pytest.mark.parametrize("end,dtype", [(10, None), (3, torch.float32), (13, torch.int32)])
def test_arange(mesh, spec, end, dtype):
    t = dt.arange(end, device_mesh=mesh, placements=on_mesh(mesh, spec), dtype=dtype)
    ref = torch.arange(end, dtype=dtype)
    _check_layout(t, mesh, spec, (end,), ref.dtype)
    assert torch.equal(t.full_tensor(), ref)


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (R, R)], ids=str)
def test_empty(mesh, spec):
    t = dt.empty(10, 7, device_mesh=mesh, placements=on_mesh(mesh, spec))
    _check_layout(t, mesh, spec, (10, 7), torch.get_default_dtype())
    t.fill_(1.5)  # an empty tensor is usable once written
    assert_close(t.full_tensor(), torch.full((10, 7), 1.5))


def test_factory_requires_grad_and_trains(mesh):
    w = dt.zeros(10, 7, device_mesh=mesh, placements=on_mesh(mesh, (S0, S1)), requires_grad=True)
    assert w.requires_grad and w.is_leaf
    x = torch.randn(10, 7)
    ((w + 1) * distribute(x, mesh, on_mesh(mesh, (S0, R)))).sum().backward()
    assert_close(w.grad.full_tensor(), x)


def test_factory_on_submesh(mesh2d):
    t = dt.ones(10, 7, device_mesh=mesh2d["tp"], placements=[S1])
    assert t.device_mesh == mesh2d["tp"] and t.placements == (S1,)
    assert_close(t.full_tensor(), torch.ones(10, 7))


# ---------------------------------------------------------------------------------------------
# *_like and new_* on distributed tensors
# ---------------------------------------------------------------------------------------------
LIKE_OPS = {
    "zeros_like": (torch.zeros_like, True),
    "ones_like": (torch.ones_like, True),
    "full_like": (lambda t: torch.full_like(t, -3.0), True),
    "ones_like_f64": (lambda t: torch.ones_like(t, dtype=torch.float64), True),
    "empty_like": (lambda t: torch.empty_like(t).fill_(4.0), True),
    "new_zeros": (lambda t: t.new_zeros((4, 5)), False),
    "new_ones": (lambda t: t.new_ones(3), False),
    "new_full": (lambda t: t.new_full((2, 6), 7.0), False),
    "new_empty": (lambda t: t.new_empty((5,)).zero_(), False),
}


@pytest.mark.parametrize("name", list(LIKE_OPS))
@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (P, S2), (PMAX, R)], ids=str)
def test_like_and_new_factories(mesh, name, spec):
    op, same_shape = LIKE_OPS[name]
    x = torch.randn(10, 7, 3)
    out = check(mesh, op, [x], [spec])[0]
    if same_shape:
        # a like-factory keeps the input's shards (a Partial input gives a Replicate result)
        expected = tuple(p if isinstance(p, dt.Shard) else R for p in on_mesh(mesh, spec))
        assert out.placements == expected


# ---------------------------------------------------------------------------------------------
# copy_ / fill_ / zero_ / clone / detach / .to(dtype)
# ---------------------------------------------------------------------------------------------
COPY_CASES = [  # (dst placements, src shape, src placements)
    ((S0, R), (10, 7), (S0, R)),
    ((S0, S1), (10, 7), (R, S0)),  # src reshuffled into dst's layout
    ((S1, R), (7,), (S0, R)),  # broadcast source
    ((R, R), (10, 7), (P, S1)),
    ((P, R), (10, 7), (P, R)),
]


@pytest.mark.parametrize("dst_spec,src_shape,src_spec", COPY_CASES, ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float64])
def test_copy_(mesh, dst_spec, src_shape, src_spec, src_dtype):
    dst, src = torch.randn(10, 7), torch.randn(src_shape, dtype=src_dtype)

    def fn(d, s):
        d = d * 1.0  # a non-leaf destination, so that autograd follows the copy
        d.copy_(s)
        return d

    check(mesh, fn, [dst, src], [dst_spec, src_spec], grad=(0, 1))


def test_copy_keeps_destination_placement(mesh2d):
    d = distribute(torch.zeros(10, 7), mesh2d, [S0, S1])
    s = distribute(torch.randn(10, 7), mesh2d, [S1, R])
    out = d.copy_(s)
    assert out is d and d.placements == (S0, S1)


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (R, R), (S2, S0)], ids=str)
@pytest.mark.parametrize("op", ["fill_", "fill_tensor", "zero_"])
def test_fill_and_zero(mesh, spec, op):
    x = torch.randn(10, 7, 3)

    def fn(t):
        t = t.clone()
        if op == "fill_":
            return t.fill_(-0.5)
        if op == "fill_tensor":
            return t.fill_(torch.tensor(2.0))
        return t.zero_()

    out = check(mesh, fn, [x], [spec])[0]
    assert out.placements == tuple(on_mesh(mesh, spec))


@pytest.mark.parametrize("spec", [(P, S0), (PMAX, R)], ids=str)
def test_zero_keeps_partial(mesh, spec):
    x = distribute(torch.randn(10, 7), mesh, on_mesh(mesh, spec))
    x.zero_()
    assert x.placements == tuple(on_mesh(mesh, spec))
    assert_close(x.full_tensor(), torch.zeros(10, 7))


CONVERSIONS = {
    "clone": lambda t: t.clone(),
    "detach": lambda t: t.detach() * 1.0,
    "to_f64": lambda t: t.to(torch.float64),
    "to_bf16": lambda t: t.to(torch.bfloat16),
    "to_int": lambda t: (t * 4).to(torch.int32),
    "double": lambda t: t.double(),
    "type_as": lambda t: t.type_as(torch.zeros((), dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(CONVERSIONS))
@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (P, S2), (PMAX, S0)], ids=str)
def test_clone_detach_to(mesh, name, spec):
    x = torch.randn(10, 7, 3)
    grad = (0,) if name in ("clone", "to_f64", "double", "type_as") else ()
    out = check(mesh, CONVERSIONS[name], [x], [spec], grad=grad, atol=1e-2 if name == "to_bf16" else 1e-5)[0]
    if name in ("clone", "to_f64", "double", "to_bf16"):
        assert out.placements == tuple(on_mesh(mesh, spec))  # no communication


def test_detach_shares_nothing_with_autograd(mesh):
    x = distribute(torch.randn(10, 7), mesh, on_mesh(mesh, (S0, S1)), requires_grad=True)
    d = x.detach()
    assert not d.requires_grad and d.placements == x.placements
    assert_close(d.full_tensor(), x.full_tensor())
