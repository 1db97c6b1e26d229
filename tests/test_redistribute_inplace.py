"""Redistributions that reuse a dying source's buffer (``Collective.consume``), and those that must not.

The controller marks a collective ``consume`` when its source dies with it: the handle was freed
before the batch left and nothing after the collective in the batch reads it, or the source is
the previous step's fresh result. A worker then builds an all-reduce's result in the source's
buffer, unless something of its own (a view, an alias) shares that memory. Values are always
compared with plain torch, on every runner and over uneven shards; where the workers live in
this process (inline, thread) the tests also look at their stores, and between processes the
gloo cases at the end look at DistExchange's results.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import dtorch_core as dt
from dtorch_core.comm.collectives import combine_all, combine_one
from dtorch_core.comm.dist import DistExchange
from dtorch_core.comm.exchange import PENDING
from dtorch_core.comm.inprocess import InProcessExchange, LockstepExchange
from dtorch_core.controller import session as session_module
from dtorch_core.ir.instructions import Call, Collective, DefineMesh, Delete, Fetch
from dtorch_core.placement import Partial, Shard
from dtorch_core.planner.emit import mark_consumed
from dtorch_core.spec import local_shapes
from dtorch_core.worker import collectives as worker_collectives
from dtorch_core.worker.loop import CollectiveStep, Worker

from .helpers import assert_close, run_ranks

P_SUM, P_AVG, P_MAX = dt.Partial("sum"), dt.Partial("avg"), dt.Partial("max")


def _calls_add_a_reference() -> bool:
    """Whether the interpreter holds one more reference to a call's argument than a plain call
    does. Seen after a torch.compile that dtorch refused (tests/test_torch_compile.py's
    test_dtensor_in_a_closure_is_refused, run earlier in the sequential suite): from then on every
    worker's sole_holder counts one reference too many and copies (values stay right). Not fixed
    yet (issue 18's holder report); the buffer checks below say so instead of failing."""
    def count(x):
        return sys.getrefcount(x)
    return count(object()) != 2  # the argument and getrefcount's own


def _check_buffers(stores, sources, tid, what: str) -> None:
    if _calls_add_a_reference():
        pytest.xfail("the interpreter holds an extra reference per call (after a refused torch.compile)")
    for rank, store in enumerate(stores):
        assert store[tid].data_ptr() == sources[rank, tid], f"rank {rank} copied its {what}"


@pytest.fixture
def spy(runner, monkeypatch):
    """The Collectives the session sends, and for in-process workers the data pointer of every
    all-reduce's source just before it ran: (rank, dst) -> pointer."""
    session = session_module._session
    sent: list = []
    submit = session.runner.submit
    monkeypatch.setattr(session.runner, "submit", lambda batch: (sent.extend(batch), submit(batch))[1])
    sources: dict = {}
    run = worker_collectives.WorkerCollectives._collective

    def recording(self, ins):
        src = self.store.get(ins.src)
        if isinstance(src, torch.Tensor) and ins.kind == "all_reduce":
            sources[self.rank, ins.dst] = src.data_ptr()
        src = None  # a reference held here would count as a holder
        run(self, ins)

    monkeypatch.setattr(worker_collectives.WorkerCollectives, "_collective", recording)
    dt.synchronize()
    sent.clear()
    return session, sent, sources


@contextlib.contextmanager
def one_batch(session):
    """Nothing leaves while the block runs (neither the timer nor the batch size flush), so the
    frees of the block travel with its collectives; synchronized after."""
    with session._lock:
        saved, session._flush_at = session._flush_at, 1 << 30
        try:
            yield
        finally:
            session._flush_at = saved
    dt.synchronize()


def _stores(session):
    return [w.store for w in getattr(session.runner, "workers", ())] or None


def _collectives(sent) -> list:
    return [ins for ins in sent if type(ins) is Collective]


@pytest.mark.parametrize("src,dst", [(P_SUM, dt.Replicate()), (P_AVG, dt.Replicate()), (P_MAX, dt.Replicate()),
                                     (P_SUM, dt.Shard(0)), (P_SUM, dt.Shard(1))])
def test_a_dropped_partial_is_reduced_in_its_own_buffer(mesh1d, spy, src, dst):
    session, sent, sources = spy
    t = torch.randn(7, 5)  # uneven over 4 ranks both ways
    x = dt.distribute_tensor(t, mesh1d, [src])
    with one_batch(session):
        y = x.clone().redistribute(mesh1d, [dst])  # the Partial copy dies at once
    (step,) = _collectives(sent)
    assert step.consume, step
    assert_close(y, t)
    assert_close(x, t)
    stores = _stores(session)
    # the buffer itself where the workers live in this process (between processes: the gloo cases below)
    if stores is not None and step.kind == "all_reduce":
        _check_buffers(stores, sources, y._tid, "dying source")


def test_a_held_partial_keeps_its_value(mesh1d, spy):
    session, sent, sources = spy
    t = torch.randn(6, 3)
    p = dt.distribute_tensor(t, mesh1d, [P_SUM]) * 3
    with one_batch(session):
        y = p.redistribute(mesh1d, [dt.Replicate()])
    (step,) = _collectives(sent)
    assert not step.consume
    assert_close(y, t * 3)
    assert_close(p, t * 3)  # the user's Partial still reads its own value
    assert p.placements == (P_SUM,)
    stores = _stores(session)
    if stores is not None:
        for rank, store in enumerate(stores):
            assert store[y._tid].data_ptr() != sources[rank, y._tid]


def test_a_source_read_again_in_the_batch_is_copied(mesh1d, spy):
    session, sent, _ = spy
    t = torch.randn(5, 4)
    x = dt.distribute_tensor(t, mesh1d, [P_SUM])
    with one_batch(session):
        p = x * 2
        y = p.redistribute(mesh1d, [dt.Replicate()])
        z = p.redistribute(mesh1d, [dt.Shard(0)])  # reads p after the all-reduce
        del p
    first, second = _collectives(sent)
    assert not first.consume and second.consume
    assert_close(y, t * 2)
    assert_close(z, t * 2)


def test_a_view_of_a_dropped_partial_keeps_its_value(mesh1d, spy):
    """A view holds its base (autograd's ``_base``), so the base's handle is not freed."""
    session, sent, _ = spy
    t = torch.randn(4, 6)
    x = dt.distribute_tensor(t, mesh1d, [P_SUM])
    with one_batch(session):
        p = x * 2
        v = p.view(24)
        y = p.redistribute(mesh1d, [dt.Replicate()])
        del p
    (step,) = _collectives(sent)
    assert not step.consume
    assert_close(y, t * 2)
    assert_close(v, (t * 2).view(24))


def test_an_alias_of_a_dropped_partial_keeps_its_value(mesh1d, spy):
    """The controller frees the Partial's id, but another id names the same memory on the
    workers (a redistribution that moves nothing): the workers see it and copy."""
    session, sent, sources = spy
    t = torch.randn(4, 6)
    x = dt.distribute_tensor(t, mesh1d, [P_SUM])
    with one_batch(session):
        p = x * 2
        q = p.redistribute(mesh1d, [P_SUM])  # an alias: no data moves
        y = p.redistribute(mesh1d, [dt.Replicate()])
        del p
    alias, step = _collectives(sent)
    assert alias.kind == "alias" and step.consume  # the controller's part: p died with the step
    assert_close(y, t * 2)
    assert_close(q, t * 2)  # the workers' part: q names p's memory, so it was copied
    stores = _stores(session)
    if stores is not None:
        for rank, store in enumerate(stores):
            assert store[y._tid].data_ptr() != sources[rank, y._tid]


def test_later_steps_of_a_plan_consume_their_fresh_source(mesh2d, spy):
    session, sent, sources = spy
    t = torch.randn(5, 3)
    x = dt.distribute_tensor(t, mesh2d, [P_SUM, P_SUM])
    with one_batch(session):
        y = x.redistribute(mesh2d, [dt.Replicate(), dt.Replicate()])
    steps = _collectives(sent)
    assert [s.kind for s in steps] == ["all_reduce", "all_reduce"]
    assert [s.consume for s in steps] == [False, True]  # x is held; the first step's result is not
    assert_close(y, t)
    assert_close(x, t)
    # the second step reduces into the first one's result on every rank: on the thread runner a
    # worker reaches it while a peer of the first step has not taken its result yet, so the
    # communicator must not hold the results it handed out (see test_a_taken_result_...)
    stores = _stores(session)
    if stores is not None:
        _check_buffers(stores, sources, y._tid, "fresh source")


def test_full_tensor_of_a_dropped_partial(mesh1d, spy):
    session, _, _ = spy
    t = torch.randn(9, 2)
    x = dt.distribute_tensor(t, mesh1d, [P_SUM])
    with session._lock:
        got = (x + x).full_tensor()
    torch.testing.assert_close(got, 2 * t)
    assert_close(x, t)


def test_mark_consumed_marks_sources_freed_and_not_read_after():
    batch = [
        Collective("all_reduce", 1, 0, 10, 11),  # 10 freed, read by nothing after: marked
        Collective("all_reduce", 1, 0, 20, 21),  # 20 freed but a Call reads it after
        Call(5, (20,), (22,)),
        Collective("all_gather", 1, 0, 30, 31),  # 30 not freed
        Collective("alias", 1, 0, 40, 41),  # 40 freed, but an alias moves nothing
        Collective("reduce_scatter", 1, 0, 50, 51),  # 50 fetched after
        Fetch(50, 1, (0,)),
    ]
    out = mark_consumed(list(batch), [10, 20, 40, 50])
    assert [getattr(i, "consume", None) for i in out] == [True, False, None, False, False, False, None]
    assert out[2] is batch[2]


def test_owned_members_get_results_in_their_own_buffers():
    """The in-process arithmetic: a member whose source is consumed gets its result in it; the
    bits equal those of the copying path."""
    g = torch.Generator().manual_seed(3)
    for k, owned in [(2, (True, False)), (2, (False, True)), (3, (False, True, True)), (4, (False, False, True, False)),
                     (3, (True, True, True))]:
        for op in ("sum", "avg", "max", "min"):
            values = [torch.randn(3, 4, generator=g) for _ in range(k)]
            expected = combine_all("all_reduce", [v.clone() for v in values], 0, op, 0)
            ptrs = [v.data_ptr() for v in values]
            got = combine_all("all_reduce", values, 0, op, 0, owned=owned)
            for i in range(k):
                assert torch.equal(got[i], expected[i]), (k, owned, op, i)
                assert (got[i].data_ptr() == ptrs[i]) == owned[i], (k, owned, op, i)
            assert len({r.data_ptr() for r in got}) == k  # every member its own tensor


@pytest.mark.parametrize("lockstep", [False, True], ids=["threads", "lockstep"])
def test_a_taken_result_is_held_by_its_member_alone(lockstep):
    """The in-process communicators: once a member has its result, the group's slot no longer
    holds it, though its peers have yet to take theirs. On the thread runner the worker that
    computes the results keeps the turn and runs on, into a later step that consumes its result,
    before its peers wake: a slot holding the result made it copy."""
    turn = threading.Lock()
    ex = LockstepExchange() if lockstep else InProcessExchange(timeout=10.0, turn=turn)
    key, size = (1, 0, 0, 0), 3
    values = [torch.randn(4, 2) for _ in range(size)]
    expected = combine_all("all_reduce", [v.clone() for v in values], 0, "sum", 0)
    compute = CollectiveStep(Collective("all_reduce", 1, 0, 1, 2, 0, "sum"), 0, owned=True)
    own, values[0] = values[0], None  # member 0's source: held by the test through ``own`` alone
    ptr = own.data_ptr()
    got: dict = {}
    if lockstep:
        for i in range(size):
            assert ex.exchange(key, i, size, own if i == 0 else values[i], compute) is PENDING
        own = None
        first = ex.collect(key, 0, compute)
    else:
        def member(i):  # as a thread runner worker: holds the turn, gives it up while it waits
            with turn:
                got[i] = ex.exchange(key, i, size, values[i], compute)

        peers = [threading.Thread(target=member, args=(i,)) for i in (1, 2)]
        for p in peers:
            p.start()
        deadline = time.monotonic() + 10.0
        while (key not in ex._slots or ex._slots[key].arrived < 2) and time.monotonic() < deadline:
            time.sleep(0.001)
        turn.acquire()  # the peers cannot take their results until it is given up
        first, own = ex.exchange(key, 0, size, own, compute), None  # the last to arrive: computes
    assert first.data_ptr() == ptr  # built in member 0's own source
    held = sys.getrefcount(first) - 2  # less this variable and getrefcount's argument
    referrers = [type(r).__name__ for r in gc.get_referrers(first)]
    if lockstep:
        got = {i: ex.collect(key, i, compute) for i in (1, 2)}
    else:
        turn.release()
        for p in peers:
            p.join(10.0)
    assert held == 0, referrers
    for i, want in enumerate(expected):
        torch.testing.assert_close(first if i == 0 else got[i], want)
    assert key not in ex._slots


# ---------------------------------------------------------------------------------------------
# between processes (gloo): DistExchange through the worker, both payload paths
# ---------------------------------------------------------------------------------------------
WORLD = 2


def _run_worker_cases(rank: int, native: bool) -> None:
    worker = Worker(rank, torch.device("cpu"), kernels=None, exchange=DistExchange(rank, torch.device("cpu"),
                                                                                   native=native),
                    reply=lambda r: None)
    worker.execute(DefineMesh(1, (WORLD,), tuple(range(WORLD))))
    tid = 100
    for op in ("sum", "avg", "max"):
        for shape in ((5, 3), (7,)):
            shapes = local_shapes(shape, (Partial(op),), (WORLD,))
            values = [torch.randn(shape, generator=torch.Generator().manual_seed(10 * r + len(shape)))
                      for r in range(WORLD)]
            expected = combine_all("all_reduce", [v.clone() for v in values], 0, op, 0)[rank]
            for consume, hold_view in ((True, False), (False, False), (True, True)):
                src = values[rank].clone()
                worker.store[tid] = src
                ptr = src.data_ptr()
                src = None
                view = worker.store[tid].view(-1) if hold_view else None
                worker.execute(Collective("all_reduce", 1, 0, tid, tid + 1, 0, op, 0, shapes, torch.float32,
                                          consume=consume))
                got = worker.store[tid + 1]
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
                assert (got.data_ptr() == ptr) == (consume and not hold_view), (op, shape, consume, hold_view)
                if hold_view:
                    assert torch.equal(view, values[rank].view(-1))  # the view's memory was left alone
                worker.execute(Delete((tid, tid + 1)))
                tid += 2


# all-to-all and reduce-scatter where the layouts let the native path skip its copies (unit
# dims before the sharded one), and dtypes of other widths on the CPU path's flagged pieces:
# (kind, source placement, dim, dim2, global shape, dtype)
LAYOUTS = [
    ("all_to_all", Shard(1), 1, 2, (1, 7, 5), torch.float32),  # joined along dim 1 after a unit dim
    ("all_to_all", Shard(2), 2, 1, (1, 5, 6), torch.float32),  # sends slices of dim 1 after a unit dim
    ("all_to_all", Shard(0), 0, 1, (5, 3), torch.bfloat16),
    ("all_to_all", Shard(1), 1, 0, (3, 3), torch.int64),
    ("reduce_scatter", Partial(), 0, 0, (5, 3), torch.float64),
    ("reduce_scatter", Partial("max"), 1, 0, (2, 3), torch.int64),
    ("reduce_scatter", Partial(), 0, 0, (1, 2), torch.bfloat16),  # an empty chunk
]


def _run_layouts(rank: int, native: bool) -> None:
    ex = DistExchange(rank, torch.device("cpu"), native=native)
    ex.define_mesh(3, (WORLD,), tuple(range(WORLD)))
    for n, (kind, placement, dim, dim2, shape, dtype) in enumerate(LAYOUTS):
        shapes = local_shapes(shape, (placement,), (WORLD,))
        ins = Collective(kind, 3, 0, 1, 2, dim, placement.reduce_op if kind == "reduce_scatter" else "sum", dim2,
                         shapes, dtype)
        values = [(torch.randn(shapes[r], generator=torch.Generator().manual_seed(n * 10 + r)) * 10).to(dtype)
                  for r in range(WORLD)]
        got = ex.exchange((3, 0, 0, n), rank, WORLD, values[rank], CollectiveStep(ins, rank))
        expected = combine_one(kind, values, dim, ins.reduce_op, dim2, rank)
        assert got.shape == expected.shape and got.dtype == dtype, (n, got.shape, expected.shape)
        assert torch.equal(got, expected), (n, kind, shape, dtype)


def _entry(rank: int, store_file: str, native: bool, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
        try:
            _run_layouts(rank, native)
            _run_worker_cases(rank, native)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("native", [False, True], ids=["gathered", "native"])
def test_layouts_and_consumed_all_reduce_between_processes(native, tmp_path):
    run_ranks(_entry, lambda r: (r, str(tmp_path / "store"), native), WORLD)

