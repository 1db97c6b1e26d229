"""Reductions against plain torch: reduced dims sharded (uneven, empty shards included) or not,
keepdim, Partial inputs, and the placements that reductions over a shard produce."""

from __future__ import annotations

import math

import pytest
import torch

import dtorch_core as dt

from .helpers import P, S, check_op

INF = math.inf


def _all(dim):
    return dim is None


# name: fn(x, dim, keepdim); dim None reduces every dim
REDUCTIONS = {
    "sum": lambda x, d, k: x.sum() if _all(d) else x.sum(d, keepdim=k),
    "sum_f64": lambda x, d, k: x.sum(d, keepdim=k, dtype=torch.float64),
    "mean": lambda x, d, k: x.mean() if _all(d) else x.mean(d, keepdim=k),
    "amax": lambda x, d, k: torch.amax(x, () if _all(d) else d, k),
    "amin": lambda x, d, k: torch.amin(x, () if _all(d) else d, k),
    "max": lambda x, d, k: x.max() if _all(d) else x.max(d, keepdim=k),
    "min": lambda x, d, k: x.min() if _all(d) else x.min(d, keepdim=k),
    "prod": lambda x, d, k: x.prod() if _all(d) else x.prod(d, keepdim=k),
    "var": lambda x, d, k: x.var() if _all(d) else x.var(d, keepdim=k),
    "std_unbiased_false": lambda x, d, k: x.std(unbiased=False) if _all(d) else x.std(d, unbiased=False, keepdim=k),
    "std_correction2": lambda x, d, k: torch.std(x, d, correction=2, keepdim=k),
    "var_mean": lambda x, d, k: torch.var_mean(x, d, correction=1, keepdim=k),
    "vector_norm_1": lambda x, d, k: torch.linalg.vector_norm(x, 1, d, k),
    "vector_norm_2": lambda x, d, k: torch.linalg.vector_norm(x, 2, d, k),
    "vector_norm_inf": lambda x, d, k: torch.linalg.vector_norm(x, INF, d, k),
    "vector_norm_f64": lambda x, d, k: torch.linalg.vector_norm(x, 2, d, k, dtype=torch.float64),
    "norm_2": lambda x, d, k: x.norm() if _all(d) else torch.norm(x, 2, d, k),
    "aten_norm": lambda x, d, k: torch.ops.aten.norm(x, 3) if _all(d) else torch.ops.aten.norm(
        x, 3, [d] if isinstance(d, int) else list(d), k),
    "argmax": lambda x, d, k: x.argmax() if _all(d) else x.argmax(d, keepdim=k),
    "argmin": lambda x, d, k: x.argmin() if _all(d) else x.argmin(d, keepdim=k),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, (0, 1, 2) if _all(d) else d, k),
}
# no op of these families may fall back, backward included
BACKWARD_FALLBACK: dict = {}
# ops whose dim argument is one int
ONE_DIM = {"max", "min", "prod", "argmax", "argmin"}
SHAPE = (10, 7, 3)  # on 4 ranks: 3,3,3,1 / 2,2,2,1 / 1,1,1,0 (an empty shard)
DIMS = [(None, False), (0, True), (1, False), ((0, 2), False), ((1, -1), True)]


def _reduced(dim):
    if dim is None:
        return list(range(len(SHAPE)))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % len(SHAPE) for d in dims)


def _placements(mesh, dim, i):
    """Shards of a reduced dim and of a kept dim (``i`` rotates which ones, and the 2-D choice)."""
    red = _reduced(dim)
    kept = [d for d in range(len(SHAPE)) if d not in red] or red
    r, k = red[-1 - i % len(red)], kept[i % len(kept)]
    if mesh.ndim == 1:
        return [[S(r)], [S(k)]]
    return [[[S(r), S(k)], [S(k), S(r)], [S(r), S(r)]][i % 3]]


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction(mesh, name):
    fn = REDUCTIONS[name]
    x = torch.randn(SHAPE)
    if name == "prod":
        x = x.sign() * (0.7 + 0.6 * torch.rand(SHAPE))  # keep the product of 210 values finite
    kw = dict(grad=name not in ("argmax", "argmin"),
              backward_fallback=BACKWARD_FALLBACK.get(name, ()))
    for i, (dim, keepdim) in enumerate(DIMS):
        if name in ONE_DIM and isinstance(dim, tuple):
            continue
        for pl in _placements(mesh, dim, i):
            check_op(lambda t: fn(t, dim, keepdim), [x], [pl], mesh, **kw)
    # Partial inputs (spread over every rank): linear reductions keep them, others reduce first
    for pl in ([P] * mesh.ndim, [P, S(0)][: mesh.ndim] if mesh.ndim == 2 else [P]):
        check_op(lambda t: fn(t, 1, False), [x], [pl], mesh, **kw)


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_scan(mesh, op):
    """Scans keep every dim: the scanned dim is gathered, the others stay sharded."""
    x = torch.randn(SHAPE)
    fn = getattr(torch, op)
    for dim, pl in ((0, [S(1)] * mesh.ndim), (-1, [S(0), S(2)][: mesh.ndim]), (1, [P] * mesh.ndim)):
        check_op(lambda t: fn(t, dim), [x], [pl], mesh,
                 backward_fallback=BACKWARD_FALLBACK.get(op, ()))
    check_op(lambda t: fn(t, 2), [x], [[S(0)]] if mesh.ndim == 1 else [[S(0), S(1)]], mesh,
             expect_placements=[S(0)] if mesh.ndim == 1 else [S(0), S(1)],
             backward_fallback=BACKWARD_FALLBACK.get(op, ()))


# reductions over a sharded dim finish as a Partial; over a kept dim the shard stays
RESULT_PLACEMENT = [
    ("sum", lambda x: x.sum(0), P),
    ("sum_all", lambda x: x.sum(), P),
    ("mean", lambda x: x.mean(0), P),
    ("mean_all", lambda x: x.mean(), P),
    ("amax", lambda x: x.amax(0), dt.Partial("max")),
    ("amin", lambda x: x.amin((0, 1)), dt.Partial("min")),
    ("max_all", lambda x: x.max(), dt.Partial("max")),
    ("sum_kept", lambda x: x.sum(1), S(0)),
    ("var_kept", lambda x: x.var(-1), S(0)),
    ("max_dim_kept", lambda x: x.max(2)[0], S(0)),
    ("argmax_kept", lambda x: x.argmax(1, keepdim=True), S(0)),
    ("logsumexp_kept", lambda x: torch.logsumexp(x, 1), S(0)),
    ("norm_kept", lambda x: torch.linalg.vector_norm(x, 2, (1, 2)), S(0)),
]


@pytest.mark.parametrize("case", RESULT_PLACEMENT, ids=[c[0] for c in RESULT_PLACEMENT])
def test_reduction_does_not_gather(mesh1d, case):
    _, fn, expected = case
    x = torch.randn(SHAPE)
    check_op(fn, [x], [[S(0)]], mesh1d, grad=case[0] != "argmax_kept",
             expect_placements=[expected], backward_fallback=BACKWARD_FALLBACK.get(case[0][:3], ()))


@pytest.mark.parametrize("ord", [1, 2, INF])
def test_norm_of_sharded_dim_is_exact(mesh, ord):
    """Norms over a sharded dim combine exactly (sums / maxima of the shards), uneven shards and
    Partial inputs included, for torch.norm and torch.linalg.vector_norm."""
    x = torch.randn(7, 3)
    for pl in ([S(0)] * mesh.ndim, [S(1)] * mesh.ndim, [P] * mesh.ndim):
        for fn in (lambda t: torch.linalg.vector_norm(t, ord), lambda t: torch.norm(t, ord, dim=0, keepdim=True)):
            check_op(fn, [x], [pl], mesh)


# Partial(avg/max/min) inputs: reductions that commute with the partial reduction keep it,
# the others must see the reduced value (``None``: any placement, the value must be right)
PARTIAL_KINDS = [
    ("amax_of_max", lambda x: x.amax(1), "max", "max"),
    ("max_all_of_max", lambda x: x.max(), "max", "max"),
    ("amin_of_min", lambda x: x.amin((0, 1)), "min", "min"),
    ("sum_of_avg", lambda x: x.sum(0), "avg", "avg"),
    ("mean_of_avg", lambda x: x.mean(), "avg", "avg"),
    ("amin_of_max", lambda x: x.amin(1), "max", None),
    ("sum_of_max", lambda x: x.sum(0), "max", None),
    ("mean_of_min", lambda x: x.mean(1), "min", None),
    ("amax_of_avg", lambda x: x.amax(0), "avg", None),
    ("logsumexp_of_avg", lambda x: torch.logsumexp(x, 1), "avg", None),
    ("norm_of_max", lambda x: torch.linalg.vector_norm(x, 2, 0), "max", None),
    ("argmax_of_max", lambda x: x.argmax(1), "max", None),
]


@pytest.mark.parametrize("case", PARTIAL_KINDS, ids=[c[0] for c in PARTIAL_KINDS])
def test_reduction_of_partial_kinds(mesh, case):
    name, fn, kind, kept = case
    x = torch.randn(10, 7)
    choices = [[dt.Partial(kind)] * mesh.ndim] + ([[S(1), dt.Partial(kind)]] if mesh.ndim == 2 else [])
    for pl in choices:
        expect = None if kept is None or pl[0] != dt.Partial(kind) else [dt.Partial(kept)] * mesh.ndim
        check_op(fn, [x], [pl], mesh, grad=not name.startswith("argmax"),
                 expect_placements=expect)
