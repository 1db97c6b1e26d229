"""The native hot path (dtorch_core._fastpath) against the Python dispatcher it stands in for:
the same instructions (plan, ids, source line, seeds), the same values, the same errors. The
whole suite runs on both paths too (CI runs it again with DTORCH_NATIVE_DISPATCH=0)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.ir.instructions import Call
from dtorch_core.planner import native_dispatch

from .helpers import assert_close, python_path

NATIVE = native_dispatch.active() == "native"
needs_native = pytest.mark.skipif(not NATIVE, reason=f"the native hot path is not active: {native_dispatch.active()}")


def test_the_native_path_is_active_where_ci_requires_it():
    if os.environ.get("DTORCH_REQUIRE_NATIVE") == "1" and os.environ.get("DTORCH_NATIVE_DISPATCH", "1") != "0":
        assert NATIVE, native_dispatch.active()
    assert native_dispatch.active() == "native" or native_dispatch.active().startswith("python (")


@contextlib.contextmanager
def held_instructions():
    """The instructions the session emits in the block, held back from the workers (then sent)."""
    session = session_module._session
    runner = session.runner
    held: list = []
    session.flush()
    runner.submit = held.append
    try:
        yield held
    finally:
        session.flush()
        del runner.submit
        for batch in held:
            runner.submit(batch)


def _program(a, b):
    c = a + b
    d = (c * 2.0).relu()
    e = torch.sigmoid(d) - a
    f = e.neg().exp()
    return f * 0.5 + c


def _calls(batches):
    return [i for batch in batches for i in batch if type(i) is Call]


@needs_native
def test_same_instructions_and_values_as_the_python_path(mesh1d):
    x = torch.randn(9, 5)
    y = torch.randn(9, 5)
    a = dt.distribute_tensor(x, mesh1d, [dt.Shard(0)])  # 9 rows on 4 ranks: 3/3/3/0
    b = dt.distribute_tensor(y, mesh1d, [dt.Shard(0)])
    with python_path():
        _program(a, b)  # plans built; both paths then hit the cache
    session = session_module._session
    runs = {}
    for name, ctx in (("python", python_path), ("native", contextlib.nullcontext)):
        start = session._tid
        with ctx(), held_instructions() as held:
            out = _program(a, b)
        runs[name] = (start, _calls(held), out)
    (p_start, p_calls, p_out), (n_start, n_calls, n_out) = runs["python"], runs["native"]
    assert len(p_calls) == len(n_calls) == 9
    shift = n_start - p_start  # the second run's ids come later, by the same count
    for p, n in zip(p_calls, n_calls):
        assert n.plan_id == p.plan_id
        assert n.outputs == tuple(t + shift for t in p.outputs)
        assert n.source == p.source and n.source[0] == __file__
        assert n.seed == p.seed is None
    assert_close(n_out.full_tensor(), p_out.full_tensor())
    assert_close(n_out.full_tensor(), _program(x, y))
    assert n_out.placements == p_out.placements and n_out._spec is p_out._spec


@needs_native
def test_seeded_ops_draw_the_same_seeds(mesh1d):
    a = dt.distribute_tensor(torch.randn(8, 6), mesh1d, [dt.Shard(1)])
    results = []
    for ctx in (python_path, contextlib.nullcontext):
        dt.manual_seed(3)
        with ctx(), held_instructions() as held:
            out = torch.nn.functional.dropout(a, 0.5, training=True)
        results.append(([c.seed for c in _calls(held)], out.full_tensor()))
    assert results[0][0] == results[1][0] and any(s is not None for s in results[0][0])
    assert torch.equal(results[0][1], results[1][1])


@needs_native
def test_errors_are_the_python_paths(mesh1d):
    a = dt.distribute_tensor(torch.randn(4, 3), mesh1d, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(5, 3), mesh1d, [dt.Shard(0)])
    errors = []
    for ctx in (python_path, contextlib.nullcontext):
        with ctx(), pytest.raises(Exception) as info:
            a + b
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


@needs_native
def test_a_closed_sessions_tensor_raises_the_python_error():
    dt.init(world_size=2, runner="inline")
    mesh = dt.init_device_mesh("cpu", (2,))
    a = dt.distribute_tensor(torch.randn(4, 3), mesh, [dt.Shard(0)])
    a + a  # a plan in the cache
    dt.shutdown()
    with pytest.raises(dt.SessionError, match="has ended"):
        a + a


@needs_native
def test_recording_sees_what_the_native_path_emits(mesh1d):
    # dt.compile shadows the session's emit while it records: the native path emits through it
    a = dt.distribute_tensor(torch.randn(6, 4), mesh1d, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(6, 4), mesh1d, [dt.Replicate()])
    step = dt.compile(lambda a, b: (a * b + a).relu())
    want = (a.full_tensor() * b.full_tensor() + a.full_tensor()).relu()
    for _ in range(3):
        assert_close(step(a, b).full_tensor(), want)


@needs_native
def test_views_carry_the_same_view_state(mesh1d):
    # a view that moves nothing is on the native path too; it marks its output as a view of
    # input 0 (in-place writes through it are checked against that)
    a = dt.distribute_tensor(torch.randn(8, 6), mesh1d, [dt.Shard(0)])
    seen = []
    for ctx in (python_path, contextlib.nullcontext):
        with ctx(), held_instructions() as held:
            v = a.unsqueeze(0).transpose(1, 2)
            w = v.view(6, 8)  # a view of a view
        seen.append((len(_calls(held)), getattr(v, "_view_state", 0), v.placements, v.full_tensor(),
                     getattr(w, "_view_state", 0)))
    (pn, pv, pp, pt, pw), (nn_, nv, np_, nt, nw) = seen
    assert (pn, pv, pp, pw) == (nn_, nv, np_, nw) and pv == 1
    assert torch.equal(pt, nt) and torch.equal(nt, a.full_tensor().unsqueeze(0).transpose(1, 2))


@needs_native
def test_cache_hits_are_served_natively(mesh1d):
    # the native key (its hash computed in C++) must find the plans the Python path stored
    from dtorch_core import _fastpath

    assert _fastpath.known_hash()
    a = dt.distribute_tensor(torch.randn(9, 6), mesh1d, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(9, 6), mesh1d, [dt.Shard(0)])  # every op moves nothing
    with python_path():
        _program(a, b)
        torch.add(a, b, alpha=2.0)
    native_before, python_before = _fastpath.counts()
    for _ in range(3):
        _program(a, b)
        torch.add(a, b, alpha=2.0)  # a key with kwargs
    native, python = _fastpath.counts()
    assert (native - native_before, python - python_before) == (3 * 10, 0)


@needs_native
@pytest.mark.parametrize("make", [
    lambda x: x + 1.5,
    lambda x: x.t(),  # a view with strides that are not the contiguous ones
    lambda x: x.unsqueeze(0),  # a size-1 dim
    lambda x: x[:, :0].neg(),  # an empty tensor
    lambda x: x.double() * 2,
    lambda x: (x > 0).logical_not(),
    lambda x: x.to(torch.int64).neg(),
])
def test_handles_have_the_python_paths_metadata(mesh1d, make):
    a = dt.distribute_tensor(torch.randn(9, 5), mesh1d, [dt.Shard(0)])
    outs = []
    for ctx in (python_path, contextlib.nullcontext, contextlib.nullcontext):
        with ctx():
            out = make(a)
        outs.append(out)
    (p, n, again) = outs
    for o in (n, again):
        assert (o.shape, o.stride(), o.dtype, o.device, o.is_contiguous(), o.requires_grad, type(o)) == (
            p.shape, p.stride(), p.dtype, p.device, p.is_contiguous(), p.requires_grad, type(p))
        assert o._spec is p._spec and o.placements == p.placements
        assert torch.equal(o.full_tensor(), p.full_tensor())
    assert torch.equal(n.full_tensor(), make(a.full_tensor()))


@needs_native
def test_the_default_dtype_does_not_leak_into_handles(mesh1d):
    a = dt.distribute_tensor(torch.randn(4, 4), mesh1d, [dt.Shard(1)])
    a + a  # a plan; the handle's arguments are made on the first native hit
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = a + a
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32 and out.full_tensor().dtype == torch.float32


def _two_lines(a):
    b = a + 1.0
    return b * 2.0


@needs_native
def test_ops_inside_torch_functions_name_the_callers_line(mesh1d):
    # F.silu is Python in torch.nn.functional: the walk skips its frame (whose verdict the native
    # path keeps by the code object's address) and names this file's line, the same every call
    a = dt.distribute_tensor(torch.randn(6, 4), mesh1d, [dt.Shard(0)])
    seen = []
    for ctx in (python_path, contextlib.nullcontext, contextlib.nullcontext):
        with ctx(), held_instructions() as held:
            out = torch.nn.functional.silu(a); line = _line()  # noqa: E702 - the op's own line
        seen.append([c.source for c in _calls(held)])
        assert_close(out.full_tensor(), torch.nn.functional.silu(a.full_tensor()))
    assert seen[0] == seen[1] == seen[2] == [(__file__, line)]


def _line():
    import sys

    return sys._getframe(1).f_lineno


@needs_native
def test_sources_name_each_line_in_a_loop(mesh1d):
    # the native path keeps one source tuple per (code, instruction): lines must still differ
    a = dt.distribute_tensor(torch.randn(6, 4), mesh1d, [dt.Shard(0)])
    seen = []
    for ctx in (python_path, contextlib.nullcontext):
        with ctx(), held_instructions() as held:
            for _ in range(3):
                _two_lines(a)
        seen.append([c.source for c in _calls(held)])
    line = _two_lines.__code__.co_firstlineno
    want = [(__file__, line + 1), (__file__, line + 2)] * 3
    assert seen[0] == seen[1] == want
