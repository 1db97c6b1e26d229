"""Calls that bring numbers (planner/numbers.py) through the wire and the workers: the native
encoder and reader against the Python ones, the native worker path against the Python one, and
DropPlans."""

from __future__ import annotations

import math

import pytest
import torch

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, DropPlans, Number, Slot

from .test_native_worker import MESH, _decoded, _native_reader, both_paths, needs_native, plan, puts
from .test_wire_native import check

NUMBERS = [(), (0.5,), (-0.0, math.inf, 1e-300), tuple(float(i) for i in range(15)),  # 15: the native forms' limit
           tuple(float(i) for i in range(16)), (math.nan,)]


def _batch():
    return [Call(7, (1, 2), (3,), ("model.py", 4), None, n) for n in NUMBERS] + [
        Call(8, (3,), (4,), None, 12, (1.5, 2.5)), DropPlans((7, 8, 1 << 40))]


@needs_native
def test_the_native_encoder_writes_numbers_as_python_does():
    check(_batch(), decodes=False)  # NaN is not equal to itself: compared below by bytes
    check([c for c in _batch() if not any(map(math.isnan, getattr(c, "numbers", ())))])


@needs_native
def test_the_native_reader_reads_numbers_as_python_does():
    data = wire.encode(_batch())
    native, python = _decoded(data, _native_reader()), _decoded(data, None)
    assert repr(native) == repr(python)
    assert [getattr(x, "numbers", None) for x in python][:4] == NUMBERS[:4]
    # a Call with a number of another type (an int) is the Python decoder's
    odd = wire.encode([Call(1, (1,), (2,), None, None, (3,))])
    assert _decoded(odd, _native_reader()) == _decoded(odd, None) == [Call(1, (1,), (2,), None, None, (3,))]


def test_a_number_plan_runs_as_torch_on_both_worker_paths():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=g)
    setup = [MESH, *puts(t1=a),
             plan(1, "aten::mul.Tensor", [Slot(0), Number(0)]),
             plan(2, "aten::add.Tensor", [Slot(0), Number(1)], {"alpha": Number(0)}),
             plan(3, "aten::clamp.default", [Slot(0), None, Number(0)])]
    batch = [Call(1, (1,), (10,), None, None, (0.25,)), Call(1, (10,), (11,), None, None, (4.0,)),
             Call(2, (11,), (12,), None, None, (0.5, 3.0)), Call(3, (12,), (13,), None, None, (0.1,)),
             Call(1, (1,), (14,), None, None, ())]  # a Call that lacks its number: a kernel failure
    runs = [both_paths([setup, batch])] if _native() else []
    from .test_native_worker import run_on

    store = run_on(False, [setup, batch])[0]
    if _native():  # the numbered plans have native calls: their Calls do not take the Python path
        worker = run_on(True, [setup])[3]
        assert all(worker.plans[p].native is not None for p in (1, 2, 3))
    t12 = torch.add(a * 0.25 * 4.0, 3.0, alpha=0.5)
    for s in [store] + [r[0] for r in runs]:
        assert torch.equal(s[12], t12)
        assert torch.equal(s[13], t12.clamp(max=0.1))
        assert type(s[14]).__name__ == "WorkerFailure" and "IndexError" in s[14].message


def test_drop_plans_forgets_the_plans_on_both_worker_paths():
    setup = [MESH, plan(1, "aten::relu.default", [Slot(0)]), plan(2, "aten::neg.default", [Slot(0)])]
    for native in ([False, True] if _native() else [False]):
        from .test_native_worker import run_on

        _, _, _, w = run_on(native, [setup, [DropPlans((1, 99))]])
        assert set(w.plans) == {2}


def _native() -> bool:
    from dtorch_core.worker import native

    return native.active() == "native"


@pytest.mark.parametrize("bad", [DropPlans(([1],)), DropPlans(("x", None))])
def test_a_malformed_drop_plans_is_rejected_and_the_worker_keeps_serving(bad):
    from .test_native_worker import run_on

    setup = [MESH, plan(1, "aten::relu.default", [Slot(0)])]
    store, replies, _, w = run_on(False, [setup, [bad, *puts(t1=torch.ones(2))], [Call(1, (1,), (2,))]])
    assert torch.equal(store[2], torch.ones(2))
