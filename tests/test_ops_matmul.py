"""Contractions against plain torch: mm, bmm, addmm, baddbmm, linear, matmul (1-D to 3-D) and
einsum, with uneven shards of every dim, Partial operands, and the placements they produce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import P, R, S, check_op, sample_placements

# uneven on 4 ranks: b 3 -> 1,1,1,0; m 10 -> 3,3,3,1; k 7 -> 2,2,2,1; n 5 -> 2,2,1,0
B, M, K, N = 3, 10, 7, 5

CASES = {
    # name: (fn, input shapes)
    "mm": (torch.mm, [(M, K), (K, N)]),
    "bmm": (torch.bmm, [(B, M, K), (B, K, N)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), [(N,), (M, K), (K, N)]),
    "addmm_full_bias": (torch.addmm, [(M, N), (M, K), (K, N)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, beta=-1, alpha=0.5), [(B, M, N), (B, M, K), (B, K, N)]),
    "baddbmm_bcast": (torch.baddbmm, [(1, N), (B, M, K), (B, K, N)]),
    "linear": (F.linear, [(M, K), (N, K), (N,)]),
    "linear_nobias": (F.linear, [(M, K), (N, K)]),
    "linear_3d": (F.linear, [(B, M, K), (N, K), (N,)]),
    "matmul_2d": (torch.matmul, [(M, K), (K, N)]),
    "matmul_3d_2d": (torch.matmul, [(B, M, K), (K, N)]),
    "matmul_3d_3d": (torch.matmul, [(B, M, K), (B, K, N)]),
    "matmul_bcast": (torch.matmul, [(B, 1, M, K), (2, K, N)]),
    "matmul_2d_1d": (torch.matmul, [(M, K), (K,)]),
    "matmul_1d_2d": (torch.matmul, [(K,), (K, N)]),
    "matmul_1d_1d": (torch.matmul, [(K,), (K,)]),
    "einsum_mm": (lambda a, b: torch.einsum("ik,kj->ij", a, b), [(M, K), (K, N)]),
    "einsum_bmm": (lambda a, b: torch.einsum("bik,bkj->bij", a, b), [(B, M, K), (B, K, N)]),
    "einsum_attn": (lambda q, k: torch.einsum("bqhd,bkhd->bhqk", q, k), [(B, M, 2, K), (B, N, 2, K)]),
    "einsum_outer": (lambda a, b: torch.einsum("i,j->ij", a, b), [(M,), (N,)]),
    "einsum_sum": (lambda a, b: torch.einsum("ik,jk->i", a, b), [(M, K), (N, K)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_contraction(mesh, name):
    fn, shapes = CASES[name]
    ins = [torch.randn(s) for s in shapes]
    for pl in sample_placements(ins, mesh, 4, seed=len(name)):
        check_op(fn, ins, pl, mesh)


# placements the product keeps without gathering anything (1-D mesh, uneven sizes)
KEEPS = [
    ("mm_rows", torch.mm, [(M, K), (K, N)], [[S(0)], [R]], [S(0)]),
    ("mm_cols", torch.mm, [(M, K), (K, N)], [[R], [S(1)]], [S(1)]),
    ("mm_inner", torch.mm, [(M, K), (K, N)], [[S(1)], [S(0)]], [P]),
    ("mm_partial_lhs", torch.mm, [(M, K), (K, N)], [[P], [R]], [P]),
    ("mm_partial_rhs", torch.mm, [(M, K), (K, N)], [[R], [P]], [P]),
    ("bmm_batch", torch.bmm, [(B, M, K), (B, K, N)], [[S(0)], [S(0)]], [S(0)]),
    ("bmm_inner", torch.bmm, [(B, M, K), (B, K, N)], [[S(2)], [S(1)]], [P]),
    ("addmm_rows", torch.addmm, [(N,), (M, K), (K, N)], [[R], [S(0)], [R]], [S(0)]),
    ("addmm_cols", torch.addmm, [(N,), (M, K), (K, N)], [[S(0)], [R], [S(1)]], [S(1)]),
    ("addmm_inner", torch.addmm, [(N,), (M, K), (K, N)], [[R], [S(1)], [S(0)]], [P]),
    ("baddbmm_batch", torch.baddbmm, [(B, M, N), (B, M, K), (B, K, N)], [[S(0)], [S(0)], [S(0)]], [S(0)]),
    ("linear_colwise", F.linear, [(M, K), (N, K), (N,)], [[R], [S(0)], [S(0)]], [S(1)]),
    ("linear_rowwise", F.linear, [(M, K), (N, K)], [[S(1)], [S(1)]], [P]),
    ("matmul_3d_2d_inner", torch.matmul, [(B, M, K), (K, N)], [[S(2)], [S(0)]], [P]),
    ("matmul_3d_2d_cols", torch.matmul, [(B, M, K), (K, N)], [[R], [S(1)]], [S(2)]),
    ("matmul_even_batch", torch.matmul, [(4, M, K), (K, N)], [[S(0)], [R]], [S(0)]),
    ("einsum_batch", lambda a, b: torch.einsum("bik,bkj->bij", a, b), [(B, M, K), (B, K, N)],
     [[S(0)], [S(0)]], [S(0)]),
]


@pytest.mark.parametrize("case", KEEPS, ids=[c[0] for c in KEEPS])
def test_contraction_does_not_gather(mesh1d, case):
    _, fn, shapes, pl, expected = case
    ins = [torch.randn(s) for s in shapes]
    check_op(fn, ins, pl, mesh1d, expect_placements=expected)
    dins = [dt.distribute_tensor(t, mesh1d, p) for t, p in zip(ins, pl)]
    with dt.debug.comm_mode() as comm:
        fn(*dins)
    assert comm.counts() == {}, f"the op itself moved data: {comm.counts_by_op()}"


def test_mm_2d_mesh_placements(mesh2d):
    """Rows on one mesh dim and the inner dim on the other: a Shard and a Partial at once."""
    a, b = torch.randn(M, K), torch.randn(K, N)
    check_op(torch.mm, [a, b], [[S(0), S(1)], [R, S(0)]], mesh2d,
             expect_placements=[S(0), P])
    check_op(torch.mm, [a, b], [[S(0), S(0)], [R, R]], mesh2d,
             expect_placements=[S(0), S(0)])


# Partial(avg) goes through a product (it is linear); Partial(max/min) must be reduced first
PARTIAL_KINDS = [
    ("mm_avg_lhs", torch.mm, [(M, K), (K, N)], "avg", 0, "avg"),
    ("mm_avg_rhs", torch.mm, [(M, K), (K, N)], "avg", 1, "avg"),
    ("addmm_avg", torch.addmm, [(N,), (M, K), (K, N)], "avg", 1, "avg"),
    ("bmm_max", torch.bmm, [(B, M, K), (B, K, N)], "max", 0, None),
    ("linear_min", torch.nn.functional.linear, [(M, K), (N, K)], "min", 1, None),
]


@pytest.mark.parametrize("case", PARTIAL_KINDS, ids=[c[0] for c in PARTIAL_KINDS])
def test_contraction_of_partial_kinds(mesh1d, case):
    _, fn, shapes, kind, which, kept = case
    ins = [torch.randn(s) for s in shapes]
    pl = [[dt.Partial(kind)] if i == which else [R] for i in range(len(ins))]
    check_op(fn, ins, pl, mesh1d,
             expect_placements=None if kept is None else [dt.Partial(kept)])


def test_shape_mismatch_raises_on_controller(mesh1d):
    """A user's shape error is raised before anything runs, naming the op and the placements."""
    a = dt.distribute_tensor(torch.randn(M, K), mesh1d, [S(0)])
    b = dt.distribute_tensor(torch.randn(N, K), mesh1d, [R])
    with pytest.raises(dt.OpError, match=r"aten\.mm.*Shard\(dim=0\)"):
        torch.mm(a, b)
