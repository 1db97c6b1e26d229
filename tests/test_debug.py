"""dt.debug.comm_mode counts the collectives a block issues: by kind, op, module, and bytes."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import assert_close


class MLP(nn.Module):
    def __init__(self, d=8, ff=12):
        super().__init__()
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _tp_mlp(mesh, out=None):
    torch.manual_seed(0)
    ref = MLP()
    row = dt.nn.RowwiseParallel() if out is None else dt.nn.RowwiseParallel(output_layouts=out)
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh, {"up": dt.nn.ColwiseParallel(), "down": row})
    return ref, model


def test_megatron_mlp_forward_is_one_all_reduce(mesh1d):
    ref, model = _tp_mlp(mesh1d)
    x = torch.randn(5, 8)  # 5 rows: uneven over the mesh where it is sharded
    dx = dt.distribute_tensor(x, mesh1d, [dt.Replicate()])
    with dt.debug.comm_mode() as comm:
        y = model(dx)
    # column-parallel up, row-parallel down: the only exchange is the Partial -> Replicate output
    assert comm.counts() == {"all_reduce": 1}
    assert comm.total() == 1
    assert comm.bytes() == {"all_reduce": 5 * 8 * 4}
    assert "MLP" in comm.counts_by_module() and comm.counts_by_module()["Global"] == {"all_reduce": 1}
    assert_close(y, ref(x), rtol=1e-5, atol=1e-6)


def test_sequence_parallel_output_is_a_reduce_scatter(mesh1d):
    ref, model = _tp_mlp(mesh1d, out=dt.Shard(0))
    x = torch.randn(7, 8)
    with dt.debug.comm_mode() as comm:
        y = model(dt.distribute_tensor(x, mesh1d, [dt.Replicate()]))
    assert comm.counts() == {"reduce_scatter": 1}
    assert y.placements == (dt.Shard(0),)
    assert_close(y, ref(x), rtol=1e-5, atol=1e-6)


def test_counts_by_op_name_the_op_that_moved_data(mesh1d):
    a, b = torch.randn(6, 10), torch.randn(10, 4)
    da = dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])
    db = dt.distribute_tensor(b, mesh1d, [dt.Shard(1)])
    with dt.debug.comm_mode() as comm:
        out = torch.mm(da, db)  # needs one side gathered
        rep = out.redistribute(mesh1d, [dt.Replicate()])
    by_op = comm.counts_by_op()
    assert set(by_op) <= {"aten.mm.default", "redistribute"}
    assert sum(by_op.get("aten.mm.default", {}).values()) >= 1
    assert_close(rep, a @ b, rtol=1e-5, atol=1e-6)
    # outside the block nothing more is counted
    before = comm.total()
    torch.mm(da, db)
    assert comm.total() == before


def test_no_communication_for_local_work(mesh2d):
    x = dt.distribute_tensor(torch.randn(9, 6), mesh2d, [dt.Shard(0), dt.Shard(1)])
    with dt.debug.comm_mode() as comm:
        y = (x * 2 + 1).relu()
        z = y.redistribute(mesh2d, [dt.Shard(0), dt.Shard(1)])  # same placements: nothing moves
    assert comm.counts() == {} and comm.bytes() == {}
    assert_close(z, (x.full_tensor() * 2 + 1).relu())


def test_data_parallel_gradients_count_as_one_exchange(mesh2d):
    torch.manual_seed(0)
    model = dt.nn.data_parallel(MLP(), mesh2d["dp"])
    x = dt.distribute_tensor(torch.randn(6, 8), mesh2d, [dt.Shard(0), dt.Replicate()])
    with dt.debug.comm_mode() as comm:
        model(x).sum().backward()
    by_op = comm.counts_by_op()
    assert by_op.get("data_parallel gradients") == {"all_reduce": 1}


def test_replays_count_what_their_recording_issued(mesh1d):
    _, model = _tp_mlp(mesh1d)
    step = dt.compile(lambda x: model(x))
    x = dt.distribute_tensor(torch.randn(4, 8), mesh1d, [dt.Replicate()])
    for _ in range(4):  # warm-up, two recordings, then replays
        step(x)
    assert step.replays >= 1
    with dt.debug.comm_mode() as comm:
        step(x)
        step(x)
    assert comm.counts() == {"all_reduce": 2}


def test_module_tracking_can_be_turned_off(mesh1d):
    _, model = _tp_mlp(mesh1d)
    with dt.debug.comm_mode(track_modules=False) as comm:
        model(dt.distribute_tensor(torch.randn(3, 8), mesh1d, [dt.Replicate()]))
    assert comm.counts_by_module() == {"Global": {"all_reduce": 1}}
