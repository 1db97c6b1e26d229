"""The worker's native per-op path (dtorch_core._workerpath) against the Python path it stands in
for: the same stores (values bit for bit, the same failures), replies and logs for the same
batches, and the same results as plain torch on the runners (CI runs the whole suite again with
DTORCH_NATIVE_WORKER=0)."""

from __future__ import annotations

import collections
import importlib
import os

import pytest
import structlog
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.errors import WorkerError
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import (
    Call,
    DefineMesh,
    DefinePlan,
    DefineProgram,
    Delete,
    Fetch,
    Put,
    RunProgram,
    Slot,
    WorkerFailure,
)
from dtorch_core.plugins import get_plugins
from dtorch_core.worker import native
from dtorch_core.worker.kernels import KernelRegistry
from dtorch_core.worker.loop import LocalPlan, Worker
from dtorch_core.worker.streams import WorkerStreams

from .helpers import DEVICE, WORLD_SIZE, S, bad_index_raises, mutated_messages

# the comparisons force each path on their own workers, so they run under DTORCH_NATIVE_WORKER=0 too
needs_native = pytest.mark.skipif(not native.available(), reason=f"the extension is not built: {native.active()}")


def test_the_native_path_is_active_where_ci_requires_it():
    if os.environ.get("DTORCH_REQUIRE_NATIVE") == "1":
        assert native.available(), native.active()
        if os.environ.get("DTORCH_NATIVE_WORKER", "1") != "0":
            assert native.active() == "native"
    assert native.active() == "native" or native.active().startswith("python (")


def test_dtorch_info_says_which_path_workers_take(monkeypatch):
    from dtorch_core.cli import collect_info, format_info

    info = collect_info()
    assert info.worker_path == native.active()
    assert f"worker op path:   {native.active()}" in format_info(info)
    monkeypatch.setenv("DTORCH_NATIVE_WORKER", "0")
    assert collect_info().worker_path == "python (DTORCH_NATIVE_WORKER=0)"


def test_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("DTORCH_NATIVE_WORKER", "0")
    assert native.active() == "python (DTORCH_NATIVE_WORKER=0)"
    w = Worker(0, torch.device("cpu"), KernelRegistry("kernels"), None, lambda r: None)
    assert w.run_calls is None


# -- one worker, the same batches on both paths --------------------------------------------------
class RecordingStreams(WorkerStreams):
    """CPU streams that report outstanding communication, and record what compute joined."""

    outstanding = True

    def __init__(self, device):
        super().__init__(device)
        self.joined: list = []

    def join_reads(self, values) -> None:
        self.joined.append([id(v) for v in values])


def run_on(native_path: bool, batches, kernels=None, streams=None):
    """(store, replies, log events, worker) after ``batches`` on a fresh rank-0 worker."""
    replies: list = []
    w = Worker(0, torch.device("cpu"), kernels or get_plugins().registry("kernels"), None, replies.append,
               streams=streams, world_size=1, native_path=native_path)
    if native_path:
        assert w.run_calls is not None
    with structlog.testing.capture_logs() as logs:
        for batch in batches:
            w.run_batch(list(batch))
    return w.store, replies, logs, w


def assert_same_store(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        assert type(x) is type(y), k
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y, k


def both_paths(batches, kernels=None, streams_type=None):
    """Run ``batches`` on both paths; assert they agree; return the native run's store and replies."""
    py = run_on(False, batches, kernels, streams_type and streams_type(torch.device("cpu")))
    nat = run_on(True, batches, kernels, streams_type and streams_type(torch.device("cpu")))
    assert_same_store(py[0], nat[0])
    assert py[1] == nat[1]
    assert py[2] == nat[2]
    return nat


def puts(**tensors):
    return [Put(int(k[1:]), 1, {0: v}) for k, v in tensors.items()]


MESH = DefineMesh(1, (1,), (0,))


def plan(pid, target, args, kwargs=None, op_name=None, seeded=False):
    return DefinePlan(pid, 1, target, tuple(args), kwargs or {}, None, op_name or target, seeded)


@needs_native
def test_mixed_batch_matches_torch():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    setup = [MESH, *puts(t1=a, t2=b),
             plan(1, "aten::add.Tensor", [Slot(0), Slot(1)], op_name="add"),
             plan(2, "aten::mul.Tensor", [Slot(0), Slot(1)]),
             plan(3, "aten::relu.default", [Slot(0)]),
             plan(4, "aten::add.Tensor", [Slot(1), Slot(0)], {"alpha": 3}),  # keyword arguments
             plan(5, "aten::cat.default", [[Slot(0), Slot(1)], 1]),  # a nested slot: Python binds it
             plan(6, "dtorch::seeded/aten::bernoulli.p", [Slot(0), 0.5], seeded=True)]
    batch = [Call(1, (1, 2), (10,)), Call(2, (10, 2), (11,)), Call(3, (11,), (12,)), Delete((10,)),
             Call(4, (12, 1), (13,)),
             plan(7, "aten::sub.Tensor", [Slot(0), Slot(1)]),  # a plan defined between calls
             Call(7, (13, 1), (14,)), Call(5, (14, 2), (15,)), Call(6, (1,), (16,), seed=1234),
             Delete((11, 99)), Call(1, (15, 15), (17,))]
    store, _, _, _ = both_paths([setup, batch])
    t11 = (a + b) * b
    t12 = torch.relu(t11)
    t13 = torch.add(a, t12, alpha=3)
    t14 = t13 - a
    t15 = torch.cat([t14, b], 1)
    ref = {1: a, 2: b, 12: t12, 13: t13, 14: t14, 15: t15, 17: t15 + t15,
           16: torch.bernoulli(a, 0.5, generator=torch.Generator().manual_seed(1234))}
    assert sorted(store) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(store[k], v), k


def _pair(x):
    return collections.namedtuple("Pair", "low high")(x - 1, x + 1)


@needs_native
def test_tuple_list_and_scalar_outputs_and_skipped_ids():
    kernels = KernelRegistry("kernels")
    kernels.add("test::pair", _pair)
    kernels.add("test::listed", lambda x: [x * 2, x * 3, x * 4])
    kernels.add("test::scalar", lambda x: float(x.sum()))
    kernels.add("test::one_of_tuple", lambda x: (x + 5,))
    a = torch.arange(12.0).reshape(3, 4)
    setup = [MESH, *puts(t1=a),
             plan(1, "aten::max.dim", [Slot(0), 1]),
             plan(2, "test::pair", [Slot(0)]),
             plan(3, "test::listed", [Slot(0)]),
             plan(4, "test::scalar", [Slot(0)]),
             plan(5, "test::one_of_tuple", [Slot(0)])]
    batch = [Call(1, (1,), (10, 11)), Call(1, (1,), (-1, 12)), Call(1, (1,), (13, -1)),
             Call(2, (1,), (14, 15)), Call(3, (1,), (16, -1)),  # fewer ids than values: zip's pairing
             Call(3, (1,), (17, 18, 19, 20)), Call(4, (1,), (21,)), Call(5, (1,), (22,)), Call(1, (1,), ())]
    store, _, _, _ = both_paths([setup, batch], kernels)
    values, indices = a.max(1)
    ref = {1: a, 10: values, 11: indices, 12: indices, 13: values, 14: a - 1, 15: a + 1, 16: a * 2,
           17: a * 2, 18: a * 3, 19: a * 4, 22: a + 5}
    for k, v in ref.items():
        assert torch.equal(store[k], v), k
    assert store[21] == float(a.sum())
    assert sorted(store) == sorted([*ref, 21])


@needs_native
def test_failures_are_the_python_paths():
    kernels = get_plugins().registry("kernels")
    a, b = torch.randn(3, 4), torch.randn(5, 6)
    setup = [MESH, *puts(t1=a, t2=b),
             plan(1, "aten::mm.default", [Slot(0), Slot(1)], op_name="matmul"),
             plan(2, "aten::neg.default", [Slot(0)]),
             plan(3, "test::no_such_kernel", [Slot(0)], op_name="custom"),
             plan(4, "aten::add.Tensor", [Slot(0), Slot(2)])]  # needs three inputs
    batch = [Call(1, (1, 2), (10,), source=("model.py", 7)),  # the kernel raises (shapes)
             Call(2, (10,), (11, -1)),  # a failed input: the same failure
             Call(2, (55,), (12,)),  # a missing input
             Call(3, (1,), (13,)),  # an unknown kernel fails each call
             Call(4, (1, 1), (14,)),  # too few inputs for the plan
             Call(2, (1,), (15,)),
             Call(2, ([1],), (16,)),  # an invalid id: rejected, reported, the worker keeps serving
             Call(77, (1,), (17,)),  # a plan this worker does not hold: nothing happens
             Call(2, (15,), (18,))]
    store, replies, logs, _ = both_paths([setup, batch], kernels)
    failure = store[10]
    assert type(failure) is WorkerFailure and failure.op == "matmul" and failure.source == ("model.py", 7)
    assert failure.message.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert store[11] is failure
    assert type(store[12]) is WorkerFailure and "tensor 55 is not on this worker" in store[12].message
    assert type(store[13]) is WorkerFailure and store[13].op == "custom"
    assert type(store[14]) is WorkerFailure and store[14].message.startswith("IndexError")
    assert torch.equal(store[18], a)
    assert type(store[16]) is WorkerFailure and "rejected" in store[16].op
    assert len(replies) == 1 and replies[0].error == store[16]
    assert 17 not in store
    # the two paths' logs are equal (both_paths); "kernel failed" is a debug event, which the
    # logging set up by other tests may filter out
    assert "rejected an instruction" in [e["event"] for e in logs]
    assert [e["event"] for e in logs].count("kernel failed") in (0, 3)


@needs_native
def test_outstanding_communication_is_joined_first():
    a = torch.randn(4, 4)
    setup = [MESH, *puts(t1=a), plan(1, "aten::add.Tensor", [Slot(0), Slot(0)])]
    batch = [Call(1, (1,), (2,)), Call(1, (2,), (3,)), Call(1, (77,), (4,))]
    py = run_on(False, [setup, batch], streams=RecordingStreams(torch.device("cpu")))
    nat = run_on(True, [setup, batch], streams=RecordingStreams(torch.device("cpu")))
    assert_same_store(py[0], nat[0])
    assert len(py[3].streams.joined) == len(nat[3].streams.joined) == 2  # not for the missing input
    assert torch.equal(nat[0][3], a * 4)


class FailingJoinStreams(RecordingStreams):
    error = ValueError

    def join_reads(self, values) -> None:
        raise self.error("the streams cannot join")


class CrashingJoinStreams(FailingJoinStreams):
    error = RuntimeError


@needs_native
def test_a_failing_join_is_handled_as_on_the_python_path():
    a = torch.randn(2, 2)
    setup = [MESH, *puts(t1=a), plan(1, "aten::neg.default", [Slot(0)])]
    program = DefineProgram(4, (Call(1, (100,), (101,)),), (100,), (101,))
    # an invalid-data error rejects the instruction (a Call, or the replay holding it)
    store, replies, _, _ = both_paths([setup, [program, Call(1, (1,), (2,)), RunProgram(4, (1,), (3,), 0, 0)]],
                                      streams_type=FailingJoinStreams)
    assert type(store[2]) is WorkerFailure and "the streams cannot join" in store[2].message
    assert type(store[3]) is WorkerFailure and len(replies) == 2
    # anything else ends the batch, as a bug in the worker
    for native_path in (False, True):
        with pytest.raises(RuntimeError, match="cannot join"):
            run_on(native_path, [setup, [Call(1, (1,), (2,))]], streams=CrashingJoinStreams(torch.device("cpu")))


@needs_native
def test_replayed_program_runs_natively_with_the_same_results():
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    setup = [MESH, *puts(t1=a, t2=b),
             plan(1, "aten::add.Tensor", [Slot(0), Slot(1)]), plan(2, "aten::mul.Tensor", [Slot(0), Slot(1)]),
             plan(3, "dtorch::seeded/aten::bernoulli.p", [Slot(0), 0.5], seeded=True),
             DefineProgram(5, (Call(1, (100, 101), (102,)), Call(2, (102, 101), (103,)),
                               Call(3, (100,), (104,), seed=0), Delete((102,))), (100, 101), (103, 104))]
    batch = [RunProgram(5, (1, 2), (20, 21), seed=7, seed_counter=0),
             RunProgram(5, (20, 2), (22, 23), seed=7, seed_counter=1)]
    store, _, _, _ = both_paths([setup, batch])
    assert torch.equal(store[20], (a + b) * b)
    assert torch.equal(store[22], (store[20] + b) * b)
    assert not torch.equal(store[21], store[23])  # fresh seeds per replay


# -- the runners: the same program against plain torch -------------------------------------------
@pytest.mark.parametrize("shape", [(7, 5), (13, 6)])
def test_runner_program_matches_torch(runner, mesh1d, shape):
    if runner == "inline":
        pytest.skip("the inline runner steps instructions one by one (Worker.execute), never a batch")
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    w = torch.randn(shape[1], 3, generator=g)
    x = dt.distribute_tensor(a, mesh1d, [S(0)])  # uneven shards over the workers
    y = dt.distribute_tensor(b, mesh1d, [S(0)])
    wd = dt.distribute_tensor(w, mesh1d, [dt.Replicate()])
    z = torch.relu(x * y + x)
    values, indices = torch.max(z, dim=1)  # a kernel with two outputs
    m = z @ wd
    total = (m.sum(0) + values.sum()).redistribute(mesh1d, [dt.Replicate()])  # collectives between the calls
    z_ = torch.relu(a * b + a)
    values_, indices_ = torch.max(z_, dim=1)
    m_ = z_ @ w
    for got, want in ((z, z_), (values, values_), (indices, indices_), (m, m_), (total, m_.sum(0) + values_.sum())):
        got = got.full_tensor().cpu()
        assert got.dtype == want.dtype
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    if DEVICE == "cpu":
        assert torch.equal(z.full_tensor(), z_) and torch.equal(indices.full_tensor(), indices_)


def _thread_workers():
    return session_module._session.runner.workers


def _set_path(native_path: bool | None):
    """The thread runner's workers on one path (None: the one the environment says); plans are
    made again, with templates or without."""
    dt.synchronize()
    for w in _thread_workers():
        w.run_calls = native.runner(LocalPlan, native_path)
    session_module._session.plans.clear()


def _failure_message(x, idx):
    try:
        torch.index_select(x, 1, idx).full_tensor()
    except WorkerError as exc:
        return str(exc)
    raise AssertionError("the out-of-range index did not fail")


def _on_both_thread_paths(runner, step) -> dict:
    """``step()`` with the thread runner's workers on the Python path, then on the native one."""
    if runner != "thread":
        pytest.skip("toggles the thread runner's workers in this process")
    try:
        return {native_path: (_set_path(native_path), step())[1] for native_path in (False, True)}
    finally:
        _set_path(None)


@needs_native
def test_thread_runner_both_paths_same_results(runner, mesh1d):
    a = torch.randn(WORLD_SIZE * 2 + 1, 4)

    def step():
        x = dt.distribute_tensor(a, mesh1d, [S(0)])
        values, indices = torch.max(torch.tanh(x * 2 - x.exp()), dim=1)
        return values.full_tensor().cpu(), indices.full_tensor().cpu()

    results = _on_both_thread_paths(runner, step)
    assert all(torch.equal(p, n) for p, n in zip(results[False], results[True]))
    values, indices = torch.max(torch.tanh(a * 2 - a.exp()), dim=1)
    assert torch.allclose(results[True][0], values, rtol=1e-5, atol=1e-6)
    assert torch.equal(results[True][1], indices)


@needs_native
@bad_index_raises
def test_thread_runner_both_paths_same_errors(runner, mesh1d):
    a = torch.randn(WORLD_SIZE * 2 + 1, 4)

    def step():
        x = dt.distribute_tensor(a, mesh1d, [S(0)])
        return _failure_message(x, dt.distribute_tensor(torch.tensor([0, 9]), mesh1d, [dt.Replicate()]))

    messages = _on_both_thread_paths(runner, step)
    assert messages[False] == messages[True]
    assert "index" in messages[True]


@needs_native
@bad_index_raises
def test_process_runner_python_path_gives_the_same_error(runner, mesh1d, monkeypatch):
    if runner != "process":
        pytest.skip("starts process workers on the Python path beside the native ones")
    a = torch.randn(WORLD_SIZE + 3, 4)
    idx = torch.tensor([1, 17])

    def run():
        mesh = dt.init_device_mesh(DEVICE, (WORLD_SIZE,), mesh_dim_names=("x",))
        x = dt.distribute_tensor(a, mesh, [S(0)])
        y = torch.sigmoid(x @ x.T.redistribute(mesh, [dt.Replicate()]))
        return y.full_tensor().cpu(), _failure_message(x, dt.distribute_tensor(idx, mesh, [dt.Replicate()]))

    native_result = run()
    dt.shutdown()
    monkeypatch.setenv("DTORCH_NATIVE_WORKER", "0")
    dt.init(world_size=WORLD_SIZE, runner="process", device_type=DEVICE, timeout=60.0)
    try:
        python_result = run()
    finally:
        dt.shutdown()  # the fixture starts the session again for the next test
    assert torch.equal(native_result[0], python_result[0])
    assert torch.allclose(native_result[0], torch.sigmoid(a @ a.T), rtol=1e-5, atol=1e-6)
    assert native_result[1] == python_result[1]


# -- the decoder's Call records in C++ (ir/wire/decode.py) ---------------------------------------
_decode_module = importlib.import_module("dtorch_core.ir.wire.decode")


def _native_reader():
    """The extension's Call reader, also where DTORCH_NATIVE_WORKER=0 keeps the decoder off it."""
    from dtorch_core import _workerpath

    _workerpath.configure_calls(Call)
    return _workerpath.read_calls


def _decoded(data, native_reader):
    """``wire.decode(data)`` with the native Call reader on or off (the whole-batch reader off: its
    tests are tests/test_wire_message_reader.py): the value, or the WireError's text."""
    saved = _decode_module._read_calls, _decode_module._read_message
    _decode_module._read_calls, _decode_module._read_message = native_reader, None
    try:
        return wire.decode(data)
    except wire.WireError as exc:
        return f"WireError: {exc}"
    finally:
        _decode_module._read_calls, _decode_module._read_message = saved


def _calls_batch():
    big = 1 << 40
    return [
        Call(1, (1, 2), (3,), ("model.py", 12), None),
        Call(2, (), (-1, 4), ("model.py", 12), 7),  # the source again: a memo reference
        Call(big, (big, -big), (5,), ("other.py", 3, None), -(1 << 62)),  # int64 ids and seed
        Delete((3, 4)),
        Call(300, tuple(range(200)), (6,), "a source that is a str", 1 << 33),
        Call(4, (7,), (8,), ("é/ünïcode.py", 40000), None),
        Call(5, (9,), (10,), ("model.py", 13), None),  # a memo tuple whose str is a reference
        Fetch(8, 3, (0,), False),
        Call(6, (-5,), (), None, 0),
    ]


@needs_native
def test_native_call_reader_decodes_what_python_decodes():
    reader = _native_reader()
    batch = _calls_batch()
    data = wire.encode(batch)
    assert _decoded(data, reader) == _decoded(data, None) == batch
    program = DefineProgram(3, tuple(c for c in batch if type(c) is Call), (1,), (2,))
    data = wire.encode([program, *batch])
    assert _decoded(data, reader) == _decoded(data, None) == [program, *batch]


@needs_native
def test_native_call_reader_rejects_what_python_rejects():
    """Flipped, dropped and inserted bytes in a batch of Calls: both decoders give the same value
    or the same WireError (message and offset); nothing crashes."""
    reader = _native_reader()
    for trial, where, mutated in mutated_messages(wire.encode(_calls_batch()), 3000):
        assert _decoded(mutated, reader) == _decoded(mutated, None), (trial, where)
