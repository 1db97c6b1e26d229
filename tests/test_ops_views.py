"""View and shape ops against plain torch: view/reshape/flatten/unflatten, transpose/permute/t,
squeeze/unsqueeze, expand, slicing and select, narrow/split/chunk/unbind, contiguous, with
uneven shards (and empty ones), Partial inputs, and in-place views."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import WORLD_SIZE, P, R, S, assert_close, check_op, sample_placements

X = (10, 7, 3)  # on 4 ranks: 3,3,3,1 / 2,2,2,1 / 1,1,1,0

VIEWS = {
    # name: (fn, input shape)
    "view_merge": (lambda x: x.view(70, 3), X),
    "view_merge_last": (lambda x: x.view(10, 21), X),
    "view_split": (lambda x: x.view(10, 7, 3), (70, 3)),
    "view_flat": (lambda x: x.view(-1), X),
    "view_ones": (lambda x: x.view(10, 1, 7, 3, 1), X),
    "reshape": (lambda x: x.reshape(5, 2, 21), X),
    "reshape_copy": (lambda x: x.transpose(0, 1).reshape(7, 30), X),
    "flatten": (lambda x: x.flatten(1), X),
    "flatten_all": (lambda x: torch.flatten(x), X),
    "unflatten": (lambda x: x.unflatten(0, (5, 2)), X),
    "unflatten_last": (lambda x: x.unflatten(-1, (1, 3)), X),
    "transpose": (lambda x: x.transpose(0, 2), X),
    "transpose_neg": (lambda x: x.transpose(-1, -2), X),
    "permute": (lambda x: x.permute(2, 0, 1), X),
    "movedim": (lambda x: x.movedim(0, -1), X),
    "t": (lambda x: x.t(), (10, 7)),
    "t_1d": (lambda x: x.t(), (7,)),
    "mT": (lambda x: x.mT, X),
    "squeeze": (lambda x: x.squeeze(), (7, 1, 3, 1)),
    "squeeze_dim": (lambda x: x.squeeze(1), (7, 1, 3, 1)),
    "squeeze_dims": (lambda x: x.squeeze((1, -1)), (7, 1, 3, 1)),
    "squeeze_not_one": (lambda x: x.squeeze(0), (7, 1, 3, 1)),
    "unsqueeze": (lambda x: x.unsqueeze(1), X),
    "unsqueeze_neg": (lambda x: x.unsqueeze(-1), X),
    "expand": (lambda x: x.expand(10, 4, 3), (10, 1, 3)),
    "expand_new_dims": (lambda x: x.expand(2, 10, 4, -1), (10, 1, 3)),
    "expand_as": (lambda x: x.expand_as(torch.empty(7, 10, 3)), (10, 3)),
    "slice": (lambda x: x[1:5], X),
    "slice_step": (lambda x: x[1:9:3], X),
    "slice_dim1": (lambda x: x[:, 2:6], X),
    "slice_neg": (lambda x: x[-4:, :, 1:], X),
    "select": (lambda x: x[:, 2], X),
    "select_neg": (lambda x: x[-1], X),
    "index_ellipsis": (lambda x: x[..., 0], X),
    "index_none": (lambda x: x[:, None, 1:3], X),
    "narrow": (lambda x: x.narrow(0, 2, 5), X),
    "narrow_last": (lambda x: torch.narrow(x, -1, 1, 2), X),
    "split": (lambda x: x.split(3), X),
    "split_sizes": (lambda x: x.split([2, 5], 1), X),
    "chunk": (lambda x: x.chunk(3, 0), X),
    "chunk_last": (lambda x: x.chunk(2, -1), X),
    "unbind": (lambda x: x.unbind(1), X),
    "unbind_last": (lambda x: torch.unbind(x, -1), X),
    "contiguous": (lambda x: x.transpose(0, 1).contiguous(), X),
    "contiguous_noop": (lambda x: x.contiguous(), X),
    "repeat": (lambda x: x.repeat(1, 2, 1), X),
    "repeat_new_dim": (lambda x: x.repeat(2, 1, 1, 3), X),
    "roll": (lambda x: x.roll(2, 1), X),
    "roll_flat": (lambda x: x.roll(3), X),
    "tril": (lambda x: x.tril(), (10, 7)),
    "triu_k": (lambda x: torch.triu(x, 2), (10, 7)),
    "tril_batched": (lambda x: x.tril(-1), X),
}
# not differentiable: forward only
VIEWS_NO_GRAD = {
    "view_dtype": (lambda x: x.view(torch.int32), X),
    "view_dtype_narrower": (lambda x: x.view(torch.int16), X),
}


@pytest.mark.parametrize("name", sorted(VIEWS_NO_GRAD))
def test_view_no_grad(mesh, name):
    fn, shape = VIEWS_NO_GRAD[name]
    x = torch.randn(shape)
    for pl in sample_placements([x], mesh, 4, seed=len(name), partial=False):
        check_op(fn, [x], pl, mesh, grad=False)
    keep = [S(1)] + [R] * (mesh.ndim - 1)  # a dim other than the last keeps its shard
    check_op(fn, [x], [keep], mesh, grad=False, expect_placements=keep)


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view(mesh, name):
    fn, shape = VIEWS[name]
    x = torch.randn(shape)
    # views are linear: Partial inputs are part of the sample
    for pl in sample_placements([x], mesh, 5, seed=len(name)):
        check_op(fn, [x], pl, mesh)


# a shard of a dim the op does not touch stays a shard: nothing is gathered (1-D mesh)
KEEPS = [
    ("view_keep_last", lambda x: x.view(70, 3), X, S(2), S(1)),
    ("view_even", lambda x: x.view(24, 5), (8, 3, 5), S(0), S(0)),
    ("view_split_even", lambda x: x.view(4, 6, 5), (24, 5), S(0), S(0)),
    ("flatten_tail", lambda x: x.flatten(1), X, S(0), S(0)),
    ("unflatten_tail", lambda x: x.unflatten(1, (7, 1)), X, S(0), S(0)),
    ("transpose", lambda x: x.transpose(0, 2), X, S(0), S(2)),
    ("permute", lambda x: x.permute(2, 0, 1), X, S(1), S(2)),
    ("t", lambda x: x.t(), (10, 7), S(1), S(0)),
    ("squeeze", lambda x: x.squeeze(), (7, 1, 3, 1), S(0), S(0)),
    ("squeeze_dim", lambda x: x.squeeze(1), (7, 1, 3, 1), S(2), S(1)),
    ("squeeze_not_one", lambda x: x.squeeze(0), (7, 1, 3, 1), S(0), S(0)),
    ("unsqueeze", lambda x: x.unsqueeze(0), X, S(1), S(2)),
    ("expand", lambda x: x.expand(2, 10, 4, 3), (10, 1, 3), S(0), S(1)),
    ("slice_other_dim", lambda x: x[:, 2:6], X, S(0), S(0)),
    ("select_other_dim", lambda x: x[:, 2], X, S(2), S(1)),
    ("narrow_other_dim", lambda x: x.narrow(1, 2, 4), X, S(0), S(0)),
    ("split_other_dim", lambda x: x.split([2, 5], 1), X, S(0), S(0)),
    ("chunk_other_dim", lambda x: x.chunk(2, -1), X, S(1), S(1)),
    ("unbind_other_dim", lambda x: x.unbind(2), X, S(0), S(0)),
    ("contiguous", lambda x: x.transpose(0, 1).contiguous(), X, S(0), S(1)),
    ("tril_rows", lambda x: x.tril(1), (10, 7), S(0), S(0)),
    ("triu_cols", lambda x: x.triu(-1), (10, 7), S(1), S(1)),
    ("repeat_other_dim", lambda x: x.repeat(1, 2, 1), X, S(0), S(0)),
    ("roll_other_dim", lambda x: x.roll(2, 1), X, S(2), S(2)),
    ("view_partial", lambda x: x.view(70, 3), X, P, P),
    ("slice_partial", lambda x: x[1:5], X, P, P),
    ("expand_partial", lambda x: x.expand(2, 10, 7, 3), X, P, P),
]


@pytest.mark.parametrize("case", KEEPS, ids=[c[0] for c in KEEPS])
def test_view_does_not_gather(mesh1d, case):
    _, fn, shape, src, expected = case
    out = check_op(fn, [torch.randn(shape)], [[src]], mesh1d)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    for o in outs:
        assert tuple(o.placements) == (expected,), f"{o.placements} != {expected}"


@pytest.mark.parametrize("k", [-3, 0, 2])
def test_triangle_of_row_and_column_shards(mesh2d, k):
    """tril/triu on shards of both matrix dims: each shard shifts the diagonal by its offsets."""
    x = torch.randn(3, 10, 7)
    for fn in (lambda t: t.tril(k), lambda t: torch.triu(t, k)):
        for pl in ([S(1), S(2)], [S(2), S(1)], [S(1), S(1)]):
            check_op(fn, [x], [pl], mesh2d, expect_placements=pl)


@pytest.mark.parametrize("op", ["unsqueeze_", "squeeze_", "transpose_", "t_"])
def test_inplace_view(mesh, op):
    """In-place views change the shape of the tensor they are called on."""
    fns = {
        "unsqueeze_": lambda a: a.unsqueeze_(1),
        "squeeze_": lambda a: a.squeeze_(1),
        "transpose_": lambda a: a.transpose_(0, -1),
        "t_": lambda a: a.t_(),
    }
    shape = (10, 1, 7) if op == "squeeze_" else (10, 7)

    def fn(x):
        y = x * 2
        out = fns[op](y)
        assert out is y
        return y.sin()

    x = torch.randn(shape)
    for pl in sample_placements([x], mesh, 4, seed=3):
        out = check_op(fn, [x], pl, mesh)
        assert out.shape == fn(x).shape


def test_matmul_vector_matrix_squeezes_in_place(mesh1d):
    """torch.matmul(1-D, 2-D) ends with squeeze_ on the product: the result has the right shape."""
    a, b = torch.randn(7), torch.randn(7, 5)
    for pl in ([[S(0)], [S(0)]], [[S(0)], [S(1)]], [[R], [S(1)]]):
        out = check_op(torch.matmul, [a, b], pl, mesh1d)
        assert out.shape == (5,) and len(out._spec.shape) == 1


def test_views_share_data_on_workers(mesh1d):
    """A write through a view that needs no redistribution reaches the base, as in torch."""
    t = torch.randn(10, 7)
    dt.set_strict(True)
    x = dt.distribute_tensor(t, mesh1d, [S(0)])
    v = x[:, 2:5]
    v.mul_(0)
    t[:, 2:5] = 0
    assert_close(x.full_tensor(), t)
    assert dt.fallback_counts() == {}


VIEW_KINDS = [
    ("view", lambda x: x.view(70, 3)),
    ("transpose", lambda x: x.transpose(0, 1)),
    ("slice", lambda x: x[2:7, 1:]),
    ("select", lambda x: x[:, 3]),
    ("expand", lambda x: x.unsqueeze(0).expand(2, 10, 7, 3)),
    ("squeeze", lambda x: x.unsqueeze(1).squeeze(1)),
    ("split", lambda x: x.split(4)),
]


@pytest.mark.parametrize("kind", ["avg", "max", "min"])
@pytest.mark.parametrize("case", VIEW_KINDS, ids=[c[0] for c in VIEW_KINDS])
def test_view_of_partial_kinds(mesh1d, case, kind):
    """Views move values without changing them: every Partial kind stays (the backward, which
    pads sliced gradients with zeros, is checked too)."""
    _, fn = case
    out = check_op(fn, [torch.randn(X)], [[dt.Partial(kind)]], mesh1d)
    for o in [out] if isinstance(out, torch.Tensor) else out:
        assert tuple(o.placements) == (dt.Partial(kind),)


# ---------------------------------------------------------------------------------------------
# diagonal, as_strided, and ops whose backward writes through a diagonal
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pl", [[S(0)], [S(2)], [P]], ids=["batch", "other", "partial"])
def test_diagonal_keeps_the_shards_of_other_dims(mesh1d, pl):
    x = torch.randn(7, 4, 5, 4)  # 7 rows: uneven over the mesh
    check_op(lambda t: torch.diagonal(t, 1, 1, 3), [x], [pl], mesh1d,
             expect_placements=[S(0)] if pl == [S(0)] else ([S(1)] if pl == [S(2)] else [P]))


def test_diagonal_of_a_sharded_diagonal_dim_is_exact(mesh1d):
    x = torch.randn(6, 5)
    check_op(lambda t: torch.diagonal(t, -1) * 2, [x], [[S(0)]], mesh1d)


def test_as_strided_of_a_sharded_tensor_matches_torch(mesh1d):
    x = torch.randn(10, 3)
    d = dt.distribute_tensor(x, mesh1d, [S(0)])
    assert_close(torch.as_strided(d, (4, 2), (3, 2), 5), torch.as_strided(x, (4, 2), (3, 2), 5))


def test_as_strided_of_a_view_of_a_replicated_tensor_reads_the_base(mesh1d):
    x = torch.randn(20)
    d = dt.distribute_tensor(x, mesh1d, [R])
    # the view starts at 5; storage_offset 0 reaches back into the base, as in torch
    assert_close(torch.as_strided(d[5:15], (2, 2), (1, 2), 0), torch.as_strided(x[5:15], (2, 2), (1, 2), 0))


def test_as_strided_of_a_view_of_a_sharded_tensor_raises(mesh1d):
    x = torch.randn(9, 4)
    d = dt.distribute_tensor(x, mesh1d, [S(0)])
    view = d[:, 1:3]  # a view that keeps the rows sharded: its storage is the shards'
    with pytest.raises(dt.OpError, match="view of a sharded tensor"):
        torch.as_strided(view, (2, 2), (4, 1), 1)
    # a view made from a gathered copy of its base addresses that copy as torch addresses the base
    assert_close(torch.as_strided(d[2:7], (3, 2), (4, 1), 1), torch.as_strided(x[2:7], (3, 2), (4, 1), 1))


@pytest.mark.parametrize("which", ["householder_product", "ormqr"])
def test_householder_backward_raises_instead_of_wrong_gradients(mesh1d, which):
    """Their backward writes through the diagonal of a gathered copy: refused, never wrong."""
    torch.manual_seed(0)
    a, tau, c = torch.randn(5, 3), torch.randn(3), torch.randn(5, 4)
    fn = (lambda a, tau: torch.linalg.householder_product(a, tau)) if which == "householder_product" else (
        lambda a, tau: torch.ormqr(a, tau, c))
    da = dt.distribute_tensor(a, mesh1d, [S(0)]).requires_grad_()
    dtau = dt.distribute_tensor(tau, mesh1d, [S(0)]).requires_grad_()
    out = fn(da, dtau)
    assert_close(out, fn(a, tau), rtol=1e-4, atol=1e-5)  # the forward is right
    with pytest.raises(dt.OpError, match="redistributed copy"):
        out.sum().backward()


# a (batch, seq) flatten keeps the sequence shard where the batch is split into single rows over
# an earlier mesh dim (CFG x sequence parallel before a Linear), and the split after it does too:
# nothing moves, uneven sequence shards included (15 over 2: 8 + 7)
NESTED = [
    # name, op, input shape for a batch of `rows`, input placements, output placements
    ("flatten", lambda x: x.flatten(0, 1), lambda rows: (rows, 15, 8), (S(0), S(1)), (S(0), S(0))),
    ("view", lambda x: x.view(-1, 8), lambda rows: (rows, 15, 8), (S(0), S(1)), (S(0), S(0))),
    ("split", lambda x: x.view(-1, 15, 8), lambda rows: (rows * 15, 8), (S(0), S(0)), (S(0), S(1))),
    ("linear", lambda x: torch.nn.functional.linear(x, torch.ones(4, 8)), lambda rows: (rows, 15, 8),
     (S(0), S(1)), (S(0), S(1))),
]


@pytest.mark.skipif(WORLD_SIZE < 2, reason="one worker holds every batch row: the view moves (a copy, its group "
                    "has one member); written for a mesh whose batch dim has one row per rank")
@pytest.mark.parametrize("case", NESTED, ids=[c[0] for c in NESTED])
def test_batch_rows_keep_sequence_shards(mesh2d, case):
    _, fn, shape, src, expected = case
    x = torch.randn(shape(mesh2d.size(0)))
    d = dt.distribute_tensor(x, mesh2d, list(src))
    with dt.debug.comm_mode() as comm:
        out = fn(d)
    assert not comm.events, comm.events
    assert tuple(out.placements) == expected
    assert_close(out.full_tensor(), fn(x))


def test_batch_of_several_rows_is_not_mistaken_for_a_run(mesh2d):
    """Two batch rows per rank with sequence shards: the flattened shard is not contiguous, so
    the view must redistribute (regions, not only sizes, are compared: here they match in size)."""
    x = torch.randn(2 * mesh2d.size(0), 2 * mesh2d.size(1), 3)
    d = dt.distribute_tensor(x, mesh2d, [S(0), S(1)])
    out = d.flatten(0, 1)
    assert_close(out.full_tensor(), x.flatten(0, 1))
