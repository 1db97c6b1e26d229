"""An all-to-all on a mesh dim whose tensor dims are also sharded on an earlier, unchanging mesh
dim (Ulysses on ("tp", "sp"): [Shard(heads), Shard(seq)] <-> [Shard(heads), Shard(heads)]).

The members of one group of mesh dim i agree on every other mesh coordinate, so they hold the
same outer chunk (one size, however uneven) and the all-to-all runs on it as on a whole tensor.
Checked three ways: the plan of every placement pair on 2-D and 3-D meshes, executed on plain
tensors with the runners' own arithmetic (comm/collectives.py), equals each rank's torch.chunk
region of the destination; on the thread and process runners (the process runner both through
all-gathers and through gloo's own all_to_all_single) with uneven sizes on both dims on (2, 2),
(2, 3) and (3, 2), values equal torch forward and backward, and each direction issues exactly
one all_to_all; a later mesh dim sharding the same tensor dim still gathers. The same for
the reduce-scatter analogue (Partial -> Shard under an unchanging outer Shard of that dim): one
reduce_scatter, each rank its region.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import dtorch_core as dt
from dtorch_core.comm.collectives import combine_all, local_step
from dtorch_core.mesh import root_coordinate
from dtorch_core.redistribute import plan_redistribute
from dtorch_core.spec import shard_region

from .helpers import DEVICE

S, R = dt.Shard, dt.Replicate()
MESHES = [(2, 2), (2, 3), (3, 2)]
# (heads, seq, head_dim): heads 5 / 7 and seq 9 / 13, uneven on every mesh above (5 heads on
# (3, 2): 2/2/1 then 1/1, 1/1, 1/0)
SHAPES = [(5, 9, 3), (7, 13, 2)]


def _nested_pairs(ndim: int):
    """Every (src, dst) of the nested kind on a 2-D mesh: the outer mesh dim shards tensor dim
    a in both; the inner one goes between Shard(b) and Shard(a), b != a, either way."""
    for a, b in itertools.permutations(range(ndim), 2):
        yield (S(a), S(b)), (S(a), S(a))
        yield (S(a), S(a)), (S(a), S(b))


def _region(t, placements, mesh_shape, coord):
    out = t
    for d, (offset, length) in enumerate(shard_region(t.shape, placements, mesh_shape, coord)):
        out = out.narrow(d, offset, length)
    return out


def _simulate(t, src, dst, mesh_shape):
    """Run ``plan_redistribute(src, dst)`` on plain local tensors, group by group, with the
    arithmetic every runner shares; each coordinate's result."""
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    local = {c: _region(t, src, mesh_shape, c).clone() for c in coords}
    for step in plan_redistribute(src, dst):
        i = step.mesh_dim
        if step.kind in ("local_chunk", "to_partial"):
            local = {c: local_step(step.kind, v, c[i], mesh_shape[i], step.dim, step.reduce_op)
                     for c, v in local.items()}
            continue
        groups: dict = {}
        for c in coords:
            groups.setdefault(c[:i] + c[i + 1:], []).append(c)
        for members in groups.values():
            results = combine_all(step.kind, [local[c] for c in members], step.dim, step.reduce_op, step.dim2)
            local.update(zip(members, results))
    return local


@pytest.mark.parametrize("mesh_shape", MESHES + [(2, 2, 2), (2, 3, 2)])
def test_every_plan_gives_each_rank_its_region(mesh_shape):
    t = torch.randn(5, 7, 3) if len(mesh_shape) == 2 else torch.randn(7, 9, 5)
    one = [R] + [S(d) for d in range(t.ndim)]
    nested = 0
    for src, dst in itertools.product(itertools.product(one, repeat=len(mesh_shape)), repeat=2):
        got = _simulate(t, src, dst, mesh_shape)
        for c, value in got.items():
            assert torch.equal(value, _region(t, dst, mesh_shape, c)), (src, dst, c)
        kinds = [s.kind for s in plan_redistribute(src, dst)]
        if len(mesh_shape) == 2 and (src, dst) in set(_nested_pairs(t.ndim)):
            assert kinds == ["all_to_all"], (src, dst, kinds)
            nested += 1
    assert nested == (12 if len(mesh_shape) == 2 else 0)


def test_when_the_all_to_all_is_not_taken():
    def kinds(src, dst):
        return [(s.kind, s.mesh_dim) for s in plan_redistribute(src, dst)]

    undo_redo = [("all_gather", 1), ("all_gather", 0), ("local_chunk", 0), ("local_chunk", 1)]
    # a later mesh dim shards the same tensor dim: its chunks nest inside mesh dim 0's, so the
    # members of a mesh-dim-0 group hold pieces of different outer chunks
    assert kinds((S(0), S(0)), (S(1), S(0))) == undo_redo
    # the outer mesh dim changes too: the inner chunks are re-cut from new outer chunks
    assert kinds((S(0), S(1)), (S(1), S(1))) == undo_redo
    # three mesh dims: the nested all-to-all on the middle one while the last shards another
    # tensor dim; not while the last shards one of the two
    assert kinds((S(0), S(1), S(2)), (S(0), S(0), S(2))) == [("all_to_all", 1)]
    assert kinds((S(0), S(1), S(1)), (S(0), S(0), S(1))) == [
        ("all_gather", 2), ("all_gather", 1), ("local_chunk", 1), ("local_chunk", 2)]


RUNNERS = ["thread", "process", "process-native"]


@pytest.fixture(scope="module", params=RUNNERS)
def six(request):
    """A 6-worker session ((2, 3) and (3, 2) need six); "process-native": the process runner with
    DTORCH_NATIVE_COLLECTIVES=1 (gloo's own all_to_all_single, as NCCL workers run it)."""
    name = request.param
    saved = os.environ.get("DTORCH_NATIVE_COLLECTIVES")
    if name == "process-native":
        os.environ["DTORCH_NATIVE_COLLECTIVES"] = "1"
    try:
        dt.init(world_size=6, runner=name.split("-")[0], device_type=DEVICE, timeout=600)  # a loaded machine
        yield name
    finally:
        dt.shutdown()  # the next test's runner fixture starts its own session
        if saved is None:
            os.environ.pop("DTORCH_NATIVE_COLLECTIVES", None)
        else:
            os.environ["DTORCH_NATIVE_COLLECTIVES"] = saved


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_nested_all_to_all_equals_torch(six, mesh_shape, shape):
    for y, t in _redistributed_in_one(("tp", "sp"), mesh_shape, shape, _nested_pairs(len(shape)), "all_to_all"):
        assert torch.equal(y.full_tensor(), t)


def _redistributed_in_one(names, mesh_shape, shape, pairs, kind):
    """For each (src, dst) of ``pairs``: a random tensor of ``shape`` distributed as src and
    redistributed to dst in exactly one ``kind`` collective, each rank holding its region; yields
    (the result, the tensor)."""
    mesh = dt.init_device_mesh(DEVICE, mesh_shape, mesh_dim_names=names)
    torch.manual_seed(sum(mesh_shape) + sum(shape))
    t = torch.randn(shape)
    for src, dst in pairs:
        x = dt.distribute_tensor(t, mesh, list(src))
        with dt.debug.comm_mode() as comm:
            y = x.redistribute(mesh, list(dst))
        assert comm.counts() == {kind: 1}, (src, dst, comm.counts())
        assert y.placements == dst
        for rank, local in y.local_shards().items():
            assert torch.equal(local, _region(t, dst, mesh_shape, root_coordinate(mesh, rank))), (src, dst, rank)
        yield y, t


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_nested_all_to_all_backward_is_one_all_to_all(six, mesh_shape):
    mesh = dt.init_device_mesh(DEVICE, mesh_shape, mesh_dim_names=("tp", "sp"))
    torch.manual_seed(1)
    t, w = torch.randn(7, 13, 2), torch.randn(7, 13, 2)
    src, dst = (S(0), S(1)), (S(0), S(0))  # Ulysses' entry: heads on tp, seq -> heads on sp
    x = dt.distribute_tensor(t, mesh, list(src)).requires_grad_(True)
    wd = dt.distribute_tensor(w, mesh, list(dst))
    y = x.redistribute(mesh, list(dst))
    loss = (y * wd).sum()
    with dt.debug.comm_mode() as comm:
        loss.backward()
    assert comm.counts_by_op().get("redistribute") == {"all_to_all": 1}, comm.counts_by_op()
    assert x.grad.placements == src
    assert torch.equal(x.grad.full_tensor(), w)


# The reduce-scatter analogue: Partial -> Shard(a) on a mesh dim while an earlier, unchanging
# mesh dim shards tensor dim a (sequence parallel on ("sp", "tp"): a row-parallel output reduced
# and scattered over "tp" within each "sp" chunk) is one reduce-scatter of the outer chunk.


def _partial_pairs(ndim: int):
    for a in range(ndim):
        yield (S(a), dt.Partial()), (S(a), S(a))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_nested_reduce_scatter_plan_gives_each_rank_its_region(mesh_shape):
    t = torch.randint(-8, 8, (5, 7, 3)).float()  # small integers: every partial sum is exact
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    for src, dst in _partial_pairs(t.ndim):
        steps = plan_redistribute(src, dst)
        assert [(s.kind, s.mesh_dim) for s in steps] == [("reduce_scatter", 1)], (src, dst, steps)
        # the members of a mesh-dim-1 group hold parts of their outer chunk: member 0 all of it
        # plus (m - 1), every other member -1
        m = mesh_shape[1]
        local = {}
        for c in coords:
            outer = _region(t, (src[0], R), mesh_shape, c)
            local[c] = outer + (m - 1) if c[1] == 0 else -torch.ones_like(outer)
        groups: dict = {}
        for c in coords:
            groups.setdefault(c[0], []).append(c)
        for members in groups.values():
            results = combine_all("reduce_scatter", [local[c] for c in members], steps[0].dim, "sum", 0)
            for c, value in zip(members, results):
                assert torch.equal(value, _region(t, dst, mesh_shape, c)), (src, dst, c)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_nested_reduce_scatter_equals_torch(six, mesh_shape, shape):
    results = list(_redistributed_in_one(("sp", "tp"), mesh_shape, shape, _partial_pairs(len(shape)), "reduce_scatter"))
    assert len(results) == len(shape)
