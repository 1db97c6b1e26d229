"""torch.compile and DTensors: calling a torch.compile'd function or module that meets a DTensor
(an input, a parameter, a closure) raises ``dt.errors.TorchCompileError`` at the first call (and
at every later one), for every backend and with or without ``fullgraph``, before anything reaches
the workers; the message names ``dt.compile``. Eager code is unchanged: outside tracing a DTensor
has no ``__tensor_flatten__``, so torch does not take it for a traceable subclass."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import dtorch_core as dt

from .helpers import assert_close

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _live(mesh):
    gc.collect()  # handles of earlier tests may still be waiting to be freed
    dt.synchronize()
    return [s["live_tensors"] for s in dt.memory_stats()]


def _refused(call):
    with pytest.raises(dt.errors.TorchCompileError, match=r"dt\.compile") as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, dt.DTorchError)
    return info.value


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_function_with_a_dtensor_input_is_refused(mesh1d, backend, fullgraph):
    t = torch.randn(7, 3)
    x = dt.distribute_tensor(t, mesh1d, [S0])
    fn = torch.compile(lambda a: (a * 2 + 1).relu(), backend=backend, fullgraph=fullgraph)
    before = _live(mesh1d)
    for _ in range(2):  # not only the first call: dynamo keeps no half-compiled frame
        _refused(lambda: fn(x))
    assert _live(mesh1d) == before  # nothing was issued
    assert dt.fallback_counts() == {}
    assert_close((x * 2 + 1).relu(), (t * 2 + 1).relu())  # eager still runs


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_module_with_dtensor_parameters_is_refused(mesh1d, backend):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    model = dt.nn.parallelize_module(
        torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4)), mesh1d,
        {"0": dt.nn.ColwiseParallel(), "2": dt.nn.RowwiseParallel()})
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        with torch.no_grad():
            p.copy_(dt.distribute_tensor(p_ref.detach(), mesh1d, p.placements))
    inp = torch.randn(5, 6)
    compiled = torch.compile(model, backend=backend)
    # the input is a plain tensor, which the first layer's input hook distributes
    _refused(lambda: compiled(inp))
    # with fullgraph the tracer stops at the same place with its own error, which says what to do
    # (after a reset: dynamo reuses the frames it kept from the call above, whatever fullgraph)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"dt\.compile\(fn\) instead"):
        torch.compile(model, backend=backend, fullgraph=True)(inp)
    # the module itself still runs eagerly, as torch does
    assert_close(model(inp), ref(inp), atol=1e-5)


def test_dtensor_in_a_closure_is_refused(mesh1d):
    w = dt.distribute_tensor(torch.randn(3, 3), mesh1d, [S1])

    @torch.compile(backend="eager")
    def f(a):
        return a @ w

    _refused(lambda: f(torch.randn(2, 3)))


def test_plain_tensors_still_compile(runner):
    fn = torch.compile(lambda a: a * 2 + 1, backend="eager", fullgraph=True)
    t = torch.randn(4)
    torch.testing.assert_close(fn(t), t * 2 + 1)


def test_eager_sees_no_traceable_subclass(mesh1d):
    x = dt.distribute_tensor(torch.randn(4, 2), mesh1d, [S0])
    assert not hasattr(x, "__tensor_flatten__")
    assert not is_traceable_wrapper_subclass(x)
    m = torch.nn.Linear(2, 2)
    m.weight = torch.nn.Parameter(dt.distribute_tensor(m.weight.detach(), mesh1d, [R]))
    m.double()  # nn.Module._apply asks is_traceable_wrapper_subclass of every parameter
    assert m.weight.dtype == torch.float64 and isinstance(m.weight, dt.DTensor)
