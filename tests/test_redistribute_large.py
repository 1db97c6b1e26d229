"""Redistributions of payloads above the CPU process workers' split size (comm/dist.py's
``SPLIT_BYTES``, 256 KiB a member): flags first, the payload alone, all-reduce as a
reduce-scatter then an all-gather (or gloo's own between two members). Every runner must give
plain torch's values bit for bit, over uneven shards, for held and for dying (consumed) sources.
"""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt
from dtorch_core.comm.dist import SPLIT_BYTES

from .helpers import BITWISE, assert_close

ROWS = SPLIT_BYTES // 4 // 96 + 3  # float32 rows of 96 columns: every member holds more than SPLIT_BYTES


def _same(got, want):
    if BITWISE:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        assert_close(got, want)


def _parts(k, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(k)]


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("dying", [False, True], ids=["held", "dying"])
def test_all_reduce(mesh1d, op, dying):
    k = mesh1d.size()
    parts = _parts(k, (ROWS + 1, 96), 1)  # + 1: not a multiple of 4, so the chunks are uneven
    p = dt.from_local(parts, mesh1d, [dt.Partial(op)])
    # a fresh source that dies with the step is reduced in its own memory (Collective.consume)
    got = (p * 1.0 if dying else p).redistribute(mesh1d, [dt.Replicate()])
    want = parts[0].clone()
    for v in parts[1:]:  # group order, as every runner reduces
        want = torch.maximum(want, v) if op == "max" else want + v
    if op == "avg":
        want = want / k
    for r in range(k):
        _same(got.to_local(r), want)
    _same(p.to_local(1), parts[1])  # the held source is untouched


def test_all_reduce_between_two_members(mesh2d):
    """Each "tp" group has two members: their float sums run as gloo's own all-reduce."""
    parts = _parts(mesh2d.size(), (ROWS, 96), 2)
    p = dt.from_local(parts, mesh2d, [dt.Replicate(), dt.Partial()])
    got = p.redistribute(mesh2d, [dt.Replicate(), dt.Replicate()])
    for r in range(mesh2d.size()):
        first = r - r % 2
        _same(got.to_local(r), parts[first] + parts[first + 1])


@pytest.mark.parametrize("rows", [4 * ROWS, 4 * ROWS - 3], ids=["even", "uneven"])
def test_all_gather_and_all_to_all(mesh1d, rows):
    full = torch.randn(rows, 96, generator=torch.Generator().manual_seed(3))
    x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
    _same(x.redistribute(mesh1d, [dt.Replicate()]).to_local(2), full)
    y = x.redistribute(mesh1d, [dt.Shard(1)])
    for r in range(mesh1d.size()):
        _same(y.to_local(r), full.chunk(mesh1d.size(), dim=1)[r])
    _same(y.full_tensor(), full)
