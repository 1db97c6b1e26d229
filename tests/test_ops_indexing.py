"""Selection, indexing and joining ops against plain torch, forward and backward:
where / masked_fill, index_select / gather (and scatter_add / index_add, their backward), cat /
stack. Shapes give uneven (and some empty) shards on 4 ranks; strict mode is on."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import check, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1, S2 = dt.Shard(0), dt.Shard(1), dt.Shard(2)


@pytest.fixture(autouse=True)
def strict(runner):
    dt.set_strict(True)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# where / masked_fill
# ---------------------------------------------------------------------------------------------
WHERE_CASES = [  # (cond shape, other: shape or "scalar", placements of cond, self, other)
    ((10, 7), (10, 7), (S0, R), (S0, R), (R, S1)),
    ((10, 7), (7,), (S1, S0), (S1, S0), (S0, R)),
    ((10, 1), (10, 7), (R, R), (P, S1), (P, S1)),  # linear in self and other together
    ((7,), "scalar", (S0, R), (S1, S0), None),
    ((10, 7), (10, 7), (S0, S1), (P, R), (R, S0)),
]


@pytest.mark.parametrize("cond_shape,other,cspec,xspec,ospec", WHERE_CASES, ids=str)
def test_where(mesh, cond_shape, other, cspec, xspec, ospec):
    cond = torch.rand(cond_shape, generator=_gen(1)) > 0.5
    x = torch.randn(10, 7, generator=_gen(2))
    if other == "scalar":
        check(mesh, lambda c, x: torch.where(c, x, 2.5), [cond, x], [cspec, xspec], grad=(1,))
    else:
        y = torch.randn(other, generator=_gen(3))
        check(mesh, torch.where, [cond, x, y], [cspec, xspec, ospec], grad=(1, 2))


MASKED_FILL_CASES = [  # (mask shape, placements of self, placements of mask, value)
    ((10, 7), (S0, R), (S0, R), -1.5),
    ((10, 1), (S1, S0), (R, S0), float("-inf")),
    ((7,), (S0, S1), (S0, R), 0.0),
    ((10, 7), (P, S1), (R, R), 3.0),
]


@pytest.mark.filterwarnings("ignore:dtorch. aten.masked_fill_.Scalar has no sharding rule")
@pytest.mark.parametrize("mask_shape,xspec,mspec,value", MASKED_FILL_CASES, ids=str)
@pytest.mark.parametrize("inplace", [False, True])
def test_masked_fill(mesh, mask_shape, xspec, mspec, value, inplace):
    x = torch.randn(10, 7, generator=_gen(4))
    mask = torch.rand(mask_shape, generator=_gen(5)) > 0.6

    def fn(x, m):
        return x.clone().masked_fill_(m, value) if inplace else x.masked_fill(m, value)

    # an in-place op that cannot keep a Partial input Partial has no rule (the placement of a
    # mutated tensor is fixed): it runs through the fallback, whose values are checked here
    native = not (inplace and P in xspec)
    dt.set_strict(native)
    check(mesh, fn, [x, mask], [xspec, mspec], grad=(0,), native=native)


def test_masked_fill_tensor_value(mesh):
    x = torch.randn(10, 7, generator=_gen(6))
    mask = torch.rand(10, 7, generator=_gen(7)) > 0.5
    check(mesh, lambda x, m, v: x.masked_fill(m, v), [x, mask, torch.tensor(-2.0)], [(S0, S1), (S0, S1), (R, R)],
          grad=(0,))


# ---------------------------------------------------------------------------------------------
# index_select / gather and their backward (index_add_ / scatter_add)
# ---------------------------------------------------------------------------------------------
INDEX_SELECT_CASES = [  # (dim, placements of self, placements of index or None for a plain tensor)
    (0, (S0, R), (R, R)),  # the indexed dim sharded
    (0, (S1, S0), (S0, R)),
    (1, (S0, R), None),
    (1, (R, S1), (S0, S0)),
    (-1, (P, S0), (R, R)),
]


@pytest.mark.parametrize("dim,xspec,ispec", INDEX_SELECT_CASES, ids=str)
def test_index_select(mesh, dim, xspec, ispec):
    x = torch.randn(10, 7, generator=_gen(8))
    idx = torch.tensor([0, 6, 2, 2, 5]) if dim != 0 else torch.tensor([9, 0, 3, 3, 8, 1, 4])
    check(mesh, lambda x, i: torch.index_select(x, dim, i), [x, idx], [xspec, ispec], grad=(0,))


GATHER_CASES = [  # (dim, index shape, placements of self, placements of index)
    (1, (10, 4), (S0, R), (S0, R)),
    (0, (6, 7), (S1, R), (S1, R)),
    (0, (6, 7), (R, R), (S0, S1)),  # index sharded along the gathered dim
    (1, (9, 3), (S0, S1), (R, R)),  # smaller index: shards of self cannot line up with it
    (-1, (10, 7), (P, S0), (R, S0)),
]


@pytest.mark.parametrize("dim,ishape,xspec,ispec", GATHER_CASES, ids=str)
def test_gather(mesh, dim, ishape, xspec, ispec):
    x = torch.randn(10, 7, generator=_gen(9))
    idx = torch.randint(0, x.shape[dim], ishape, generator=_gen(10))
    check(mesh, lambda x, i: torch.gather(x, dim, i), [x, idx], [xspec, ispec], grad=(0,))


@pytest.mark.parametrize("spec", [(S1, R), (R, S0), (P, S1)], ids=str)
def test_scatter_add_and_index_add(mesh, spec):
    x = torch.randn(10, 7, generator=_gen(11))
    src = torch.randn(10, 7, generator=_gen(12))
    idx = torch.randint(0, 10, (10, 7), generator=_gen(13))
    check(mesh, lambda x, i, s: torch.scatter_add(x, 0, i, s), [x, idx, src], [spec, (R, R), spec], grad=(0, 2))
    rows = torch.tensor([3, 3, 0, 9])
    check(mesh, lambda x, i, s: x.index_add(0, i, s, alpha=2.0), [x, rows, src[:4]], [spec, (R, R), (R, R)],
          grad=(0, 2))


# ---------------------------------------------------------------------------------------------
# cat / stack
# ---------------------------------------------------------------------------------------------
JOIN_CASES = [  # (dim, placements of the three inputs)
    (0, [(S1, R), (S1, R), (R, R)]),  # join along an unsharded dim
    (0, [(S0, R), (S0, S1), (R, S0)]),  # join along the sharded dim
    (1, [(S0, S1), (S0, S1), (S0, S1)]),
    (-1, [(P, S0), (P, R), (R, R)]),
]


@pytest.mark.parametrize("dim,specs", JOIN_CASES, ids=str)
@pytest.mark.parametrize("op", [torch.cat, torch.stack])
def test_cat_stack(mesh, op, dim, specs):
    xs = [torch.randn(10, 7, generator=_gen(20 + k)) for k in range(3)]
    check(mesh, lambda *ts: op(list(ts), dim=dim), xs, specs, grad=(0, 1, 2))


def test_cat_different_sizes_along_dim(mesh):
    xs = [torch.randn(n, 7, generator=_gen(n)) for n in (10, 3, 1)]
    check(mesh, lambda *ts: torch.cat(ts, dim=0), xs, [(S1, R), (S1, S0), (R, R)], grad=(0, 1, 2))


def test_cat_keeps_shards_of_other_dims(mesh2d):
    xs = [distribute(torch.randn(10, 7), mesh2d, [S1, S1]) for _ in range(2)]
    assert torch.cat(xs, dim=0).placements == (S1, S1)
    assert torch.stack(xs, dim=0).placements == (S2, S2)
    assert torch.stack(xs, dim=2).placements == (S1, S1)


# ---------------------------------------------------------------------------------------------
# advanced indexing: x[i, j] (index.Tensor) and its backward (index_put with accumulate)
# ---------------------------------------------------------------------------------------------
def _rows(n, seed):
    return torch.randint(0, n, (6,), generator=_gen(seed))


INDEX_CASES = [  # (index builder, placements of x, of the result): unindexed dims keep their (uneven) shards
    ("pool", (R, S2), (R, S1)),       # x[arange(B), pos]: CLIP's EOS pooling; the feature dim stays sharded
    ("pool", (S2, R), (S1, R)),
    ("pool", (P, R), (P, R)),         # linear: a Partial x stays Partial
    ("middle", (S0, S2), (S0, dt.Shard(3))),  # x[:, idx]: dims before and after the indexed one keep theirs
    ("split", (S1, R), (S1, R)),      # x[i, :, j]: non-adjacent indices put the index dims first
    ("pool", (S0, S1), None),         # an indexed dim sharded: gathered (the indices hold global positions)
]


def _index_fn(kind):
    if kind == "pool":
        return lambda x: x[torch.arange(5), torch.tensor([0, 6, 2, 3, 1])]
    if kind == "middle":
        return lambda x: x[:, torch.tensor([[1, 0], [6, 6]])]
    return lambda x: x[torch.tensor([4, 0, 2]), :, torch.tensor([1, 1, 10])]


@pytest.mark.parametrize("kind,xspec,ospec", INDEX_CASES, ids=str)
def test_advanced_index(mesh, kind, xspec, ospec):
    x = torch.randn(5, 7, 11, generator=_gen(11))
    (out,) = check(mesh, _index_fn(kind), [x], [xspec], grad=(0,) if P not in xspec else ())
    if ospec is not None:
        assert tuple(out.placements) == tuple(on_mesh(mesh, ospec))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("xspec,vspec", [((S1, R), (S1, R)), ((R, S1), (R, S1)), ((P, R), (P, R)), ((S0, R), (R, R))],
                         ids=str)
def test_index_put(mesh, accumulate, xspec, vspec):
    # values laid out like x[idx] (rows of x): they shard with x on the unindexed dim 1
    x = torch.randn(9, 6, generator=_gen(12))
    values = torch.randn(4, 6, generator=_gen(13))
    idx = torch.tensor([7, 0, 3, 0 if accumulate else 5])
    check(mesh, lambda x, v: x.index_put((idx,), v, accumulate=accumulate), [x, values], [xspec, vspec],
          grad=(0, 1) if P not in xspec else ())


@pytest.mark.parametrize("xspec", [(S0, R), (R, S1), (S1, S0)], ids=str)
def test_isin(mesh, xspec):
    # elements keep their (uneven) shards; the test elements are replicated
    x = torch.randint(0, 9, (7, 5), generator=_gen(14))
    test = torch.tensor([1, 4, 8])
    (out,) = check(mesh, torch.isin, [x, test], [xspec, (R, R)])
    assert tuple(out.placements) == tuple(on_mesh(mesh, xspec))
    check(mesh, lambda x: torch.isin(x, 4, invert=True), [x], [xspec])
