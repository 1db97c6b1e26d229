"""Ops whose output shape depends on the values, against plain torch on every runner: nonzero
(argwhere, ``torch.where(cond)``, ``as_tuple``), masked_select (broadcast), ``x[mask]`` and
``x[mask] = v``, unique (sorted, inverse, counts, dim, consecutive) and repeat_interleave
without ``output_size``. Shapes give uneven and empty shards on 4 ranks (7, 10 and 3 rows), and
masks that select nothing or everything; strict mode is on (no op runs through the fallback)."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import assert_close, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1 = dt.Shard(0), dt.Shard(1)
SPECS = [(R, R), (S0, R), (S1, S0), (S0, S1), (P, S0)]


@pytest.fixture(autouse=True)
def strict(runner):
    dt.set_strict(True)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _values(shape, density, seed=0):
    """Integers (exact under any Partial split) with about ``density`` of them non-zero."""
    keep = torch.rand(shape, generator=_gen(seed)) < density
    return (torch.randint(1, 5, shape, generator=_gen(seed + 1)) * keep).to(torch.float32)


def _on(mesh, t, spec):
    spec = tuple(R if isinstance(p, dt.Shard) and p.dim >= t.ndim else p for p in on_mesh(mesh, spec))
    if not t.is_floating_point():
        spec = tuple(R if p == P else p for p in spec)
    return distribute(t, mesh, spec)  # a Partial split holds exact zeros: nonzero counts them


def _same(out, ref):
    assert isinstance(out, dt.DTensor)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert_close(out.full_tensor(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape,density", [((7, 5), 0.4), ((10,), 0.5), ((3, 4, 2), 1.0), ((7, 3), 0.0)], ids=str)
def test_nonzero_family(mesh, spec, shape, density):
    t = _values(shape, density)
    x = _on(mesh, t, spec)
    out = torch.nonzero(x)
    _same(out, torch.nonzero(t))
    assert out.placements == (R,) * mesh.ndim
    _same(torch.argwhere(x), torch.argwhere(t))
    for o, r in zip(torch.nonzero(x, as_tuple=True), torch.nonzero(t, as_tuple=True)):
        _same(o, r)
    cond_x, cond_t = x > 2, t > 2
    for o, r in zip(torch.where(cond_x), torch.where(cond_t)):
        _same(o, r)


def test_nonzero_of_0d_and_empty(mesh):
    for t in (torch.tensor(3.0), torch.tensor(0.0), torch.zeros(0, 4)):
        spec = (S0, S1) if t.ndim else (R, R)
        _same(torch.nonzero(_on(mesh, t, spec)), torch.nonzero(t))


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (P, R), (R, R)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.float16])
def test_masked_select(mesh, spec, dtype):
    t = (torch.randn(10, 6, generator=_gen(3)) * 4).to(dtype)
    if dtype == torch.float32:
        t = _values((10, 6), 0.7, seed=3)
    mask = torch.rand(10, 6, generator=_gen(4)) > 0.5
    x, m = _on(mesh, t, spec), _on(mesh, mask, (S0, S1))
    _same(torch.masked_select(x, m), torch.masked_select(t, mask))
    _same(x[m], t[mask])
    none = torch.zeros_like(mask)
    _same(x[_on(mesh, none, (S1, R))], t[none])


def test_masked_select_broadcasts(mesh):
    t = torch.randn(7, 5, generator=_gen(5))
    row_mask = torch.tensor([True, False, True, True, False])
    x = _on(mesh, t, (S0, R))
    _same(torch.masked_select(x, _on(mesh, row_mask, (R, R))), torch.masked_select(t, row_mask))
    _same(torch.masked_select(_on(mesh, row_mask.float(), (S0, R)), _on(mesh, t > 0, (S1, S0))),
          torch.masked_select(row_mask.float(), t > 0))


def test_masked_select_and_mask_index_backward(mesh):
    t = torch.randn(10, 4, generator=_gen(6))
    mask = torch.rand(10, 4, generator=_gen(7)) > 0.4
    weights = torch.randn(int(mask.sum()), generator=_gen(8))
    for fn in (lambda a, m: torch.masked_select(a, m), lambda a, m: a[m]):
        x = _on(mesh, t, (S0, R)).requires_grad_(True)
        ref = t.clone().requires_grad_(True)
        (fn(x, _on(mesh, mask, (S0, S1))).full_tensor() * weights).sum().backward()
        (fn(ref, mask) * weights).sum().backward()
        assert_close(x.grad.full_tensor(), ref.grad)


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (R, R)], ids=str)
def test_leading_dim_mask_index(mesh, spec):
    t = torch.randn(7, 3, 4, generator=_gen(9))
    rows = torch.tensor([True, False, True, True, False, False, True])
    x = _on(mesh, t, spec)
    _same(x[_on(mesh, rows, (S0, R))], t[rows])
    plane = torch.rand(7, 3, generator=_gen(10)) > 0.5
    _same(x[_on(mesh, plane, (S0, S1))], t[plane])
    _same(x[:, _on(mesh, torch.tensor([True, False, True]), (R, R))], t[:, torch.tensor([True, False, True])])


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0)], ids=str)
def test_mask_assignment(mesh, spec):
    t = torch.randn(7, 5, generator=_gen(11))
    mask = t > 0.3
    x = _on(mesh, t, spec)
    x[_on(mesh, mask, (S0, S1))] = -2.0
    ref = t.clone()
    ref[mask] = -2.0
    assert_close(x.full_tensor(), ref)


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0), (P, R), (R, R)], ids=str)
@pytest.mark.parametrize("inverse,counts", [(False, False), (True, False), (True, True), (False, True)])
def test_unique(mesh, spec, inverse, counts):
    t = torch.randint(0, 6, (10, 3), generator=_gen(12)).to(torch.float32)
    x = _on(mesh, t, spec)
    out = torch.unique(x, sorted=True, return_inverse=inverse, return_counts=counts)
    ref = torch.unique(t, sorted=True, return_inverse=inverse, return_counts=counts)
    out, ref = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    for o, r in zip(out, ref):
        _same(o, r)
    if inverse:
        # the inverse keeps the input's shards (a Partial input's are reduced)
        assert out[1].placements == tuple(R if p == P else p for p in x.placements)


def test_unique_unsorted_dim_and_consecutive(mesh):
    t = torch.randint(0, 4, (7, 3), generator=_gen(13))
    x = _on(mesh, t, (S0, S1))
    values, inverse = torch.unique(x, sorted=False, return_inverse=True)  # any order, as torch says
    assert torch.equal(values.full_tensor()[inverse.full_tensor()], t)
    assert torch.equal(torch.sort(values.full_tensor()).values, torch.unique(t))
    for o, r in zip(torch.unique(x, dim=0, return_inverse=True, return_counts=True),
                    torch.unique(t, dim=0, return_inverse=True, return_counts=True)):
        _same(o, r)
    for o, r in zip(torch.unique_consecutive(x, return_inverse=True, return_counts=True),
                    torch.unique_consecutive(t, return_inverse=True, return_counts=True)):
        _same(o, r)
    empty = torch.zeros(0, dtype=torch.int64)
    _same(torch.unique(_on(mesh, empty, (S0, R))), torch.unique(empty))


@pytest.mark.parametrize("spec", [(S0, R), (R, R)], ids=str)
def test_repeat_interleave(mesh, spec):
    repeats = torch.tensor([1, 0, 3, 2, 0, 4, 1])
    r = _on(mesh, repeats, spec)
    _same(torch.repeat_interleave(r), torch.repeat_interleave(repeats))
    t = torch.randn(7, 2, generator=_gen(14))
    x = _on(mesh, t, (S1, R))
    _same(torch.repeat_interleave(x, r, dim=0), torch.repeat_interleave(t, repeats, dim=0))
    zeros = torch.zeros(3, dtype=torch.int64)
    _same(torch.repeat_interleave(_on(mesh, zeros, spec)), torch.repeat_interleave(zeros))


def test_integer_indexing_is_unchanged(mesh):
    t = torch.randn(10, 4, generator=_gen(15))
    idx = torch.tensor([3, 0, 9, 3])
    x = _on(mesh, t, (S1, R))
    out = x[_on(mesh, idx, (R, R))]
    _same(out, t[idx])
    assert out.placements == x.placements  # the integer rule keeps the unindexed dim's shards


def test_changing_counts_define_no_new_worker_plans(mesh):
    from dtorch_core.controller import session as session_module

    session = session_module._session
    defined = []
    for seed, density in enumerate((1.0, 0.6, 0.0, 0.3, 0.9)):  # from every element selected to none
        t = _values((10, 6), density, seed=20 + seed)
        x = _on(mesh, t, (S0, S1))
        _same(x[x > 0], t[t > 0])
        _same(torch.nonzero(x), torch.nonzero(t))
        _same(torch.unique(x), torch.unique(t))
        defined.append(len(session.plan_names))
    assert len(set(defined)) == 1, defined  # the first call defines the worker plans, the rest reuse them
