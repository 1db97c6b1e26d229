"""redistribute onto another mesh of the same devices (what MeshMismatchError advises), on every
runner with uneven shards; between meshes of different devices, an error saying what to do."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt

from .helpers import DEVICE, assert_close, needs_world_size

S, R, P = dt.Shard, dt.Replicate, dt.Partial


@pytest.fixture
def meshes(runner):
    grid = dt.init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    line = dt.init_device_mesh(DEVICE, (4,), mesh_dim_names=("x",))
    return grid, line


CASES = [
    # (from the 2x2 grid, to the 4-line, collectives expected)
    ([S(0), S(0)], [S(0)], {}),  # rank r holds rows chunk r either way: nothing moves
    ([R(), R()], [S(1)], {}),  # each rank keeps its part of what it holds
    ([S(0), S(0)], [S(1)], {"all_gather": 2}),  # other regions: gathered on the grid first
    ([S(1), R()], [R()], {"all_gather": 1}),
    ([P("sum"), S(0)], [P("sum")], {"all_reduce": 1, "all_gather": 1}),  # a Partial source is reduced first
]


@needs_world_size(4)
@pytest.mark.parametrize("src,dst,comms", CASES)
def test_redistribute_onto_a_mesh_of_the_same_devices(meshes, src, dst, comms):
    grid, line = meshes
    a = torch.randn(7, 5)  # 7 rows over 2 and 4, 5 columns over 4: uneven
    x = dt.distribute_tensor(a, grid, src)
    with dt.debug.comm_mode() as comm:
        y = x.redistribute(line, dst)
    assert comm.counts() == comms
    assert y.device_mesh == line and y.placements == tuple(dst)
    assert_close(y.full_tensor(), a)
    back = y.redistribute(grid, [S(1), R()])
    assert back.device_mesh == grid and back.placements == (S(1), R())
    assert_close(back.full_tensor(), a)


@needs_world_size(4)
def test_redistribute_between_meshes_is_differentiable_and_reaches_sub_meshes(meshes):
    grid, line = meshes
    a, w = torch.randn(7, 5), torch.randn(5, 3)
    x = dt.distribute_tensor(a, grid, [S(0), S(1)]).requires_grad_(True)
    on_line = x.redistribute(line, [S(0)])
    wd = dt.distribute_tensor(w, line, [R()])
    (on_line @ wd).square().sum().backward()
    ag = a.clone().requires_grad_(True)
    (ag @ w).square().sum().backward()
    assert x.grad.device_mesh == grid and x.grad.placements == (S(0), S(1))
    assert_close(x.grad.full_tensor(), ag.grad, rtol=1e-5, atol=1e-5)
    # onto a sub-mesh of the grid: the dims it leaves out are replicated
    z = on_line.redistribute(grid["tp"], [S(1)])
    assert z.device_mesh == grid["tp"] and z.placements == (S(1),)
    assert_close(z.full_tensor(), a)


@needs_world_size(4)
def test_mesh_mismatch_advice_works_and_other_devices_are_refused(meshes):
    grid, line = meshes
    a = torch.randn(6, 4)
    x = dt.distribute_tensor(a, grid, [S(0), R()])
    y = dt.distribute_tensor(a, line, [S(0)])
    with pytest.raises(dt.MeshMismatchError, match="redistribute them onto one mesh"):
        x + y
    assert_close((x.redistribute(line, [S(0)]) + y).full_tensor(), 2 * a)  # the advice, followed
    pair = dt.init_device_mesh(DEVICE, (2,), mesh_dim_names=("pair",))
    with pytest.raises(dt.PlacementError, match=r"different devices.*dt.distribute_tensor\(x.full_tensor\(\), mesh"):
        x.redistribute(pair, [R()])
