"""Every pair of placements on every mesh dim, with uneven shards, forward and backward."""

from __future__ import annotations

import itertools

import pytest
import torch

import dtorch_core as dt

from .helpers import DEVICE, WORLD_SIZE, assert_close, needs_world_size

ONE_DIM = [dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Partial("sum"), dt.Partial("max"), dt.Partial("avg")]


def test_all_pairs_1d(mesh1d):
    t = torch.randn(7, 5)  # 7 rows / 5 cols on 4 ranks: 2,2,2,1 and 2,2,1,0
    for src, dst in itertools.product(ONE_DIM, ONE_DIM):
        x = dt.distribute_tensor(t, mesh1d, [src])
        y = x.redistribute(mesh1d, [dst])
        assert y.placements == (dst,)
        assert_close(y, t, msg=f"{src} -> {dst}")


@pytest.mark.parametrize("src", list(itertools.product([dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Partial()], repeat=2)))
def test_all_pairs_2d(mesh2d, src):
    t = torch.randn(5, 3)
    x = dt.distribute_tensor(t, mesh2d, list(src))
    for dst in itertools.product([dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Partial()], repeat=2):
        y = x.redistribute(mesh2d, list(dst))
        assert tuple(y.placements) == dst
        assert_close(y, t, msg=f"{src} -> {dst}")


@needs_world_size(4)
def test_local_shards_follow_torch_chunk(mesh1d):
    t = torch.arange(10.0)
    x = dt.distribute_tensor(t, mesh1d, [dt.Shard(0)])
    shards = x.local_shards()
    for rank, expected in enumerate(torch.chunk(t, 4)):
        assert torch.equal(shards[rank], expected)
    y = dt.distribute_tensor(torch.arange(3.0), mesh1d, [dt.Shard(0)])
    assert [s.numel() for s in y.local_shards().values()] == [1, 1, 1, 0]


@needs_world_size(4)
def test_nested_shards_on_one_dim(mesh2d):
    t = torch.randn(9, 2)
    x = dt.distribute_tensor(t, mesh2d, [dt.Shard(0), dt.Shard(0)])
    assert [s.shape[0] for s in x.local_shards().values()] == [3, 2, 2, 2]
    assert_close(x, t)
    assert_close(x.redistribute(mesh2d, [dt.Replicate(), dt.Shard(0)]), t)
    assert_close(x.redistribute(mesh2d, [dt.Shard(1), dt.Shard(0)]), t)


@pytest.mark.parametrize(
    "src,dst",
    [
        ([dt.Shard(0)], [dt.Replicate()]),
        ([dt.Replicate()], [dt.Shard(1)]),
        ([dt.Shard(0)], [dt.Shard(1)]),
        ([dt.Partial()], [dt.Replicate()]),
        ([dt.Partial()], [dt.Shard(0)]),
    ],
)
def test_redistribute_backward(mesh1d, src, dst):
    t = torch.randn(7, 6)
    w = torch.randn(7, 6)
    x = dt.distribute_tensor(t, mesh1d, src).requires_grad_()
    y = x.redistribute(mesh1d, dst)
    (y * dt.distribute_tensor(w, mesh1d, dst)).sum().backward()
    assert_close(x.grad, w)
    # the gradient of Shard->Replicate is a shard again, never an accidental Partial
    if src[0] != dt.Partial():
        assert x.grad.placements == tuple(src)


@needs_world_size(4)
def test_sub_mesh_placements(mesh2d):
    t = torch.randn(6, 4)
    tp = mesh2d["tp"]
    x = dt.distribute_tensor(t, tp, [dt.Shard(1)])
    assert x.device_mesh == tp and x.placements == (dt.Shard(1),)
    assert x._spec.placements == (dt.Replicate(), dt.Shard(1))
    y = dt.distribute_tensor(torch.randn(4, 3), mesh2d, [dt.Replicate(), dt.Replicate()])
    assert_close(x @ y, t @ y.full_tensor())
    assert mesh2d.get_coordinate(3) == (1, 1) and tp.get_coordinate(2) == (0,)


def test_a_partial_input_is_reduced_once_while_unchanged(mesh, monkeypatch):
    from dtorch_core.controller.session import current_session

    session = current_session()
    reductions = []
    emit = session.emit

    def spy(ins):
        if getattr(ins, "kind", None) in ("all_reduce", "reduce_scatter"):
            reductions.append(ins)
        emit(ins)

    monkeypatch.setattr(session, "emit", spy)
    g_full = torch.randn(7, 3)  # 7 rows: uneven over the shards
    g = dt.distribute_tensor(g_full, mesh, [dt.Partial()] * mesh.ndim)
    acc = dt.distribute_tensor(torch.zeros(7, 3), mesh, [dt.Replicate()] * mesh.ndim)
    ref = torch.zeros(7, 3)
    acc.lerp_(g, 0.1)
    acc.addcmul_(g, g, value=0.5)  # the optimizer pattern: one gradient, several reads
    ref.lerp_(g_full, 0.1)
    ref.addcmul_(g_full, g_full, value=0.5)
    assert len(reductions) == mesh.ndim  # one all-reduce per mesh dim, not one per read
    assert_close(acc, ref)
    g.mul_(2)  # a write: the kept reduction is stale
    acc.add_(g)
    ref.add_(g_full * 2)
    assert len(reductions) == 2 * mesh.ndim
    assert_close(acc, ref)
    view = g[1:4]
    view.mul_(3)  # a write through a view changes g as well
    acc.add_(g)
    g_full = g_full * 2
    g_full[1:4] *= 3
    ref.add_(g_full)
    assert_close(acc, ref)


def test_collectives_in_a_group_of_one_are_local_copies(runner):
    mesh = dt.init_device_mesh(DEVICE, (WORLD_SIZE, 1), mesh_dim_names=("x", "one"))
    t = torch.randn(7, 3)
    for src in ONE_DIM:
        for dst in ONE_DIM:
            x = dt.distribute_tensor(t, mesh, [dt.Shard(0), src])
            y = x.redistribute(mesh, [dt.Shard(0), dst])
            assert y.placements == (dt.Shard(0), dst)
            assert_close(y, t, msg=f"{src} -> {dst}")
            if isinstance(src, (dt.Shard, dt.Partial)) and not isinstance(dst, dt.Partial) and src != dst:
                y.mul_(2)  # a gather, reduction or all-to-all makes a tensor of its own
                assert_close(x, t, msg=f"{src} -> {dst} aliased its source")


# a peer that waits needs at least two workers; the inline runner runs CPU workers only
@pytest.mark.skipif(WORLD_SIZE < 2, reason="needs at least two workers")
@pytest.mark.parametrize("_runner_name", [
    pytest.param("inline", marks=pytest.mark.skipif(DEVICE != "cpu", reason="the inline runner is CPU only")),
    "thread"], indirect=True)
def test_a_merged_all_reduce_with_a_failed_source_fails_only_its_dtype_group(runner, mesh1d):
    # one rank's float64 gradient failed: that rank must still make one exchange per dtype, as
    # its peers do (one exchange for everything would leave them waiting for a second)
    from dtorch_core.planner.emit import merged_hints
    from dtorch_core.ir.instructions import MergedAllReduce, WorkerFailure
    from dtorch_core.tensor import DTensor

    session = dt.api.current_session()
    values = [torch.randn(5, 3, dtype=d) for d in (torch.float32, torch.float64, torch.float32)]
    parts = [dt.distribute_tensor(v, mesh1d, [dt.Replicate()]).redistribute(mesh1d, [dt.Partial()]) for v in values]
    dt.synchronize()
    session.runner.workers[1].store[parts[1]._tid] = WorkerFailure(1, "aten.mul.default", None, "boom")
    outs, dsts = [], []
    for p in parts:
        dsts.append(session.new_tid())
        outs.append(DTensor._make(p._spec.with_placements((dt.Replicate(),)), p._view, dsts[-1], session))
    shapes, dtypes = merged_hints(session, [p._spec for p in parts])
    session.emit(MergedAllReduce(session.mesh_id(parts[0]._spec.mesh), 0, "sum", tuple(p._tid for p in parts),
                                 tuple(dsts), shapes, dtypes))
    assert_close(outs[0], values[0])
    assert_close(outs[2], values[2])
    with pytest.raises(dt.WorkerError, match="boom"):
        outs[1].full_tensor()
