"""Handles, metadata, asynchrony, memory, and errors."""

from __future__ import annotations

import gc

import threading

import pytest
import torch

import dtorch_core as dt
from dtorch_core.ops.common import R
from dtorch_core.planner.schema import Strategy
from dtorch_core.plugins import get_plugins

from .helpers import DEVICE, MESH_2D, assert_close, bad_index_raises, needs_world_size


def test_metadata_without_round_trip(mesh2d):
    x = dt.distribute_tensor(torch.randn(10, 6), mesh2d, [dt.Shard(0), dt.Replicate()])
    assert x.shape == (10, 6) and x.dtype == torch.float32
    assert x.placements == (dt.Shard(0), dt.Replicate())
    assert x.device_mesh is mesh2d
    text = repr(x)
    assert "Shard(dim=0)" in text and "mesh_dim_names=('dp', 'tp')" in text


def test_issue_example(mesh2d):
    xt, wt = torch.randn(10, 6), torch.randn(6, 8)
    x = dt.distribute_tensor(xt, mesh2d, [dt.Shard(0), dt.Replicate()])
    w = dt.distribute_tensor(wt, mesh2d, [dt.Replicate(), dt.Shard(1)])
    y = torch.nn.functional.gelu(x @ w).sum(dim=1)
    assert torch.allclose(y.full_tensor(), torch.nn.functional.gelu(xt @ wt).sum(dim=1), atol=1e-5)


def test_negative_shard_dim_is_normalised(mesh1d):
    x = dt.distribute_tensor(torch.randn(3, 5), mesh1d, [dt.Shard(-1)])
    assert x.placements == (dt.Shard(1),)


@needs_world_size(4)
def test_from_local_and_to_local(mesh1d):
    shards = [torch.full((n, 2), float(r)) for r, n in enumerate([3, 3, 3, 1])]
    x = dt.from_local(shards, mesh1d, [dt.Shard(0)])
    assert x.shape == (10, 2)
    assert_close(x, torch.cat(shards))
    assert torch.equal(x.to_local(3), shards[3])
    y = dt.from_local(torch.ones(2, 2), mesh1d, [dt.Partial()])
    assert_close(y, torch.full((2, 2), 4.0))
    with pytest.raises(dt.PlacementError):
        dt.from_local([torch.ones(2, 2)] * 4, mesh1d, [dt.Shard(0)], shape=(9, 2))


def test_factories_with_placements(mesh2d):
    z = dt.zeros(5, 3, device_mesh=mesh2d, placements=[dt.Shard(0), dt.Shard(1)])
    assert_close(z, torch.zeros(5, 3))
    f = dt.full((4, 2), 2.5, device_mesh=mesh2d, placements=[dt.Replicate(), dt.Partial()])
    assert_close(f, torch.full((4, 2), 2.5))
    a = dt.arange(7, device_mesh=mesh2d, placements=[dt.Shard(0), dt.Replicate()])
    assert_close(a, torch.arange(7))


# -- asynchrony -----------------------------------------------------------------------------
_gate = threading.Event()


@torch.library.custom_op("dtorch_test::wait_for_gate", mutates_args=())
def wait_for_gate(x: torch.Tensor) -> torch.Tensor:
    assert _gate.wait(30), "gate never opened"
    return x + 1


@wait_for_gate.register_fake
def _(x):
    return torch.empty_like(x)


def _pointwise_rule(call):
    from dtorch_core.placement import Shard

    return [Strategy((R,), (R,))] + [Strategy((Shard(d),), (Shard(d),)) for d in range(call.inputs[0].ndim)]


@pytest.fixture
def gate_op():
    ops = get_plugins().registry("ops")
    if wait_for_gate._opoverload not in ops:
        ops.add(wait_for_gate._opoverload, _pointwise_rule)
    _gate.clear()
    yield torch.ops.dtorch_test.wait_for_gate.default
    _gate.set()


def test_controller_returns_before_workers_run(gate_op):
    dt.init(world_size=2, runner="thread")
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(torch.zeros(4, 2), mesh, [dt.Shard(0)])
        y = gate_op(x)  # the workers block in the kernel until the gate opens
        z = y * 2
        assert z.shape == (4, 2)  # we got here while the workers are still blocked
        assert not _gate.is_set()
        _gate.set()
        assert_close(z, torch.full((4, 2), 2.0))
    finally:
        _gate.set()
        dt.shutdown()


# -- memory ---------------------------------------------------------------------------------
def test_dropped_handles_free_worker_memory(mesh1d):
    gc.collect()  # handles of earlier tests kept alive by reference cycles go now, not mid-test
    base = [s["live_tensors"] for s in dt.memory_stats()]
    x = dt.distribute_tensor(torch.randn(64, 64), mesh1d, [dt.Shard(0)])
    ys = [x * i for i in range(10)]
    during = dt.memory_stats()
    assert all(s["live_tensors"] >= b + 11 for s, b in zip(during, base))
    assert all(s["bytes"] >= 11 * 16 * 64 * 4 for s in during)
    del x, ys
    after = [s["live_tensors"] for s in dt.memory_stats()]
    assert after == base


# -- errors ---------------------------------------------------------------------------------
@needs_world_size(4)
def test_mesh_mismatch_raises_before_sending(runner):
    m1 = dt.init_device_mesh(DEVICE, (2,))
    m2 = dt.init_device_mesh(DEVICE, (4,))
    a = dt.distribute_tensor(torch.randn(4), m1, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(4), m2, [dt.Shard(0)])
    with pytest.raises(dt.MeshMismatchError, match="different meshes"):
        a + b


def test_invalid_placements(mesh2d):
    with pytest.raises(dt.PlacementError, match="out of range"):
        dt.distribute_tensor(torch.randn(3), mesh2d, [dt.Shard(1), dt.Replicate()])
    with pytest.raises(dt.PlacementError, match="one placement per mesh dim"):
        dt.distribute_tensor(torch.randn(3), mesh2d, [dt.Shard(0)])
    with pytest.raises(dt.PlacementError):
        dt.Partial("mean")
    with pytest.raises(dt.PlacementError, match="world_size"):
        dt.init_device_mesh(DEVICE, (8,))


def test_shape_error_names_op_and_placements(mesh1d, monkeypatch):
    a = dt.distribute_tensor(torch.randn(4, 3), mesh1d, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(4, 3), mesh1d, [dt.Replicate()])
    session = dt.api.current_session()
    sent = []
    monkeypatch.setattr(session, "emit", sent.append)
    with pytest.raises(dt.OpError, match=r"aten\.mm.*\(4, 3\)\[Shard\(dim=0\)\]"):
        a @ b
    assert sent == []  # nothing was sent


@bad_index_raises
def test_worker_failure_names_rank_op_and_source(mesh1d):
    x = dt.distribute_tensor(torch.randn(8, 3), mesh1d, [dt.Shard(1)])
    bad = torch.tensor([0, 100])  # meta tensors cannot see the bad index: the kernel fails
    y = x.index_select(0, bad)  # line that must be named
    z = y + 1  # depends on the failed op: fails the same way
    with pytest.raises(dt.WorkerError) as info:
        z.full_tensor()
    err = info.value
    assert err.op == "aten.index_select.default"
    assert err.source.endswith(f"test_core.py:{_line_of('x.index_select(0, bad)')}")
    assert 0 <= err.rank < 4
    # the worker keeps serving
    assert_close(x * 2, x.full_tensor() * 2)


@pytest.mark.filterwarnings("ignore:dtorch.*no sharding rule")
def test_linalg_errors_raise_like_torch(mesh1d):
    a = torch.eye(3).repeat(5, 1, 1) * 2
    a[3] = 0  # singular: on one rank only when the batch is sharded (5 over 4 ranks: uneven)
    x = dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])
    with pytest.raises(torch.linalg.LinAlgError) as expected:
        torch.linalg.inv(a)
    with pytest.raises(torch.linalg.LinAlgError) as got:
        torch.linalg.inv(x)
    assert str(got.value) == str(expected.value)
    a[3] = torch.eye(3)
    assert_close(torch.linalg.inv(dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])), torch.linalg.inv(a))


def _line_of(text: str) -> int:
    import inspect

    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line and "_line_of" not in line)


def test_fallback_counts_and_strict(mesh1d):
    x = dt.distribute_tensor(torch.randn(6, 4), mesh1d, [dt.Shard(0)])
    with pytest.warns(UserWarning, match="no sharding rule"):
        y = torch.cummax(x, 1).values
    assert_close(y, torch.cummax(x.full_tensor(), 1).values)
    assert dt.fallback_counts().get("aten.cummax.default") == 1
    dt.set_strict(True)
    with pytest.raises(dt.FallbackRefusedError, match="cummax"):
        torch.cummax(x, 1)


def test_fallback_in_place_writes_back_shards(mesh1d):
    t = torch.randn(7, 3)
    x = dt.distribute_tensor(t, mesh1d, [dt.Shard(0)])
    with pytest.warns(UserWarning):
        x.cumprod_(1)
    assert x.placements == (dt.Shard(0),)
    assert_close(x, t.cumprod(1))


def test_item_and_not_initialised(mesh1d):
    x = dt.distribute_tensor(torch.arange(5.0), mesh1d, [dt.Shard(0)])
    assert x.sum().item() == 10.0
    dt.shutdown()
    with pytest.raises(dt.errors.NotInitializedError):
        dt.init_device_mesh("cpu", (2,))


def test_plain_tensor_is_replicated_on_the_mesh(mesh2d):
    t = torch.randn(5, 6)
    x = dt.distribute_tensor(t, mesh2d, [dt.Shard(0), dt.Shard(1)])
    bias = torch.randn(6)
    assert_close(x + bias, t + bias)
    assert_close(bias * x, bias * t)
    bias.add_(1.0)  # later changes on the controller do not leak into issued ops
    y = x - bias
    assert_close(y, t - bias)


def test_meshes_of_the_same_devices_keep_their_own_dim_names(runner):
    plain = dt.init_device_mesh(DEVICE, MESH_2D)
    named = dt.init_device_mesh(DEVICE, MESH_2D, mesh_dim_names=("dp", "tp"))
    assert plain.mesh_dim_names is None and named.mesh_dim_names == ("dp", "tp")
    assert named["tp"].root is named and named["tp"].mesh_dim_names == ("tp",)
    t = torch.randn(5, 4)
    x = dt.distribute_tensor(t, named["tp"], [dt.Shard(1)])
    y = dt.distribute_tensor(t, plain, [dt.Shard(0), dt.Replicate()])
    assert "mesh_dim_names=('tp',)" in repr(x)
    assert torch.equal(x.full_tensor(), t) and torch.equal(y.full_tensor(), t)


def test_workers_map_the_handles_device_to_their_own():
    from dtorch_core.ir.instructions import Slot
    from dtorch_core.worker.loop import on_device

    mine = torch.device("cuda", 3)
    args = (Slot(0), [torch.device("cuda", 0), 2], torch.device("cpu"))
    assert on_device(args, mine) == (Slot(0), [mine, 2], torch.device("cpu"))
    assert on_device(torch.device("cuda"), mine) == mine


def test_a_tensor_of_an_ended_session_raises_before_anything_is_sent(runner):
    from .helpers import WORLD_SIZE

    old = dt.distribute_tensor(torch.arange(6.0), dt.init_device_mesh(DEVICE, (WORLD_SIZE,)), [dt.Shard(0)])
    dt.init(world_size=WORLD_SIZE, runner=runner, device_type=DEVICE)  # ends the old session
    mesh = dt.init_device_mesh(DEVICE, (WORLD_SIZE,))
    new = dt.distribute_tensor(torch.ones(6), mesh, [dt.Shard(0)])
    with pytest.raises(dt.SessionError, match="ended"):
        old + 1
    with pytest.raises(dt.SessionError, match="different dtorch sessions"):
        old + new
    # the new session is unharmed
    assert_close(new * 2, torch.full((6,), 2.0))
