"""Floats of foreach calls travel with each Call (ops/foreach_plan.py): torch.optim's step sizes
and a scheduled learning rate change every step, and after the first step no worker plan is
defined again. Against torch's own optimizer on the same values, over meshes of 2 and 3 ranks
with uneven shards, on every runner and both controller paths; the long number tuples (16 and
more) byte for byte through both wire encoders and both Call readers."""

from __future__ import annotations

import contextlib

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call, DefinePlan, Stats
from dtorch_core.planner import native_dispatch

from .helpers import DEVICE, WORLD_SIZE, assert_close, distribute, python_path
from .test_native_worker import _decoded, _native_reader
from .test_wire_native import _fastpath
from .test_wire_native import check as check_both_encoders

R = dt.Replicate()
SHAPES = [(7, 5), (5,), (9, 4), (4, 7)]  # uneven over 2 and 3 ranks
PLACEMENTS = [dt.Shard(0), dt.Shard(0), dt.Shard(1), R]
PATHS = ["native", "python"] if native_dispatch.active() == "native" else ["python"]

pytestmark = pytest.mark.skipif(WORLD_SIZE < 3, reason="meshes of 2 and 3 ranks need 3 workers")


def _controller(path: str):
    return python_path() if path == "python" else contextlib.nullcontext()


def _params(mesh, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    plain = [torch.nn.Parameter(torch.randn(SHAPES[k % len(SHAPES)], generator=gen)) for k in range(n)]
    dist = [torch.nn.Parameter(distribute(p.detach(), mesh, [PLACEMENTS[k % len(PLACEMENTS)]]))
            for k, p in enumerate(plain)]
    return plain, dist


def _set_grads(plain, dist, mesh, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for k, (p, d) in enumerate(zip(plain, dist)):
        p.grad = torch.randn(p.shape, generator=gen)
        d.grad = distribute(p.grad, mesh, [PLACEMENTS[k % len(PLACEMENTS)]])


def _defines(rec) -> int:
    return sum(type(i) is DefinePlan for i in rec.instructions)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scheduled_foreach_optimizer_defines_nothing_after_warm_up(runner, world, name, path):
    mesh = dt.init_device_mesh(DEVICE, (world,))
    plain, dist = _params(mesh, 6)
    opt, ref = OPTIMIZERS[name](dist), OPTIMIZERS[name](plain)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    with _controller(path):
        for step in range(5):
            _set_grads(plain, dist, mesh, step)
            with current_session().recording() as rec:
                opt.step()
            ref.step()
            sched.step()
            ref_sched.step()
            if step >= 2:  # state and plans exist: the new step sizes and lr ride on the Calls
                assert _defines(rec) == 0, step
                lengths = {len(i.numbers) for i in rec.instructions if type(i) is Call}
                assert len(dist) in lengths  # a step size per parameter
            for d, p in zip(dist, plain):
                assert_close(d, p.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [16, 300])
def test_long_number_lists_change_every_call(runner, n, path):
    mesh = dt.init_device_mesh(DEVICE, (3,))
    lists = [_params(mesh, n, seed) for seed in range(3)]
    pa, pb, pc = [[t.detach() for t in plain] for plain, _ in lists]
    a, b = [[t.detach() for t in dist] for _, dist in lists[:2]]
    pc = [t.abs() + 0.5 for t in pc]  # a divisor away from zero
    c = [distribute(t, mesh, [PLACEMENTS[k % len(PLACEMENTS)]]) for k, t in enumerate(pc)]
    with _controller(path):
        for step in range(3):
            values = [0.25 * (step + 1) - 0.01 * k for k in range(n)]
            with current_session().recording() as rec:
                torch._foreach_addcdiv_(a, b, c, values)
                torch._foreach_mul_(a, values)
            torch._foreach_addcdiv_(pa, pb, pc, values)
            torch._foreach_mul_(pa, values)
            calls = [i for i in rec.instructions if type(i) is Call]
            assert [i.numbers for i in calls] == [tuple(values)] * 2
            if step:
                assert _defines(rec) == 0
    for d, p in zip(a, pa):
        assert_close(d, p, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(_fastpath is None, reason="dtorch_core._fastpath is not built: nothing native to compare")
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 300])
def test_number_tuples_of_any_length_cross_the_wire_the_same(n):
    numbers = tuple(0.5 * k - 3.0 for k in range(n))
    batch = [Call(1, (2, 3), (4,), ("/a.py", 7), None, numbers), Stats(1),
             Call(2, (5,), (6,), ("/a.py", 7), 3, numbers)]
    check_both_encoders(batch)  # native and Python bytes agree and decode back
    from dtorch_core.ir import wire

    data = wire.encode(batch)
    native = _decoded(data, _native_reader())
    assert native == _decoded(data, None) == batch
    for cut in (len(data) - 1, len(data) - 9):  # cut inside the last numbers: the same error
        assert _decoded(data[:cut], _native_reader()) == _decoded(data[:cut], None)
