"""Decodable but invalid instructions: the worker rejects them, reports them at the next read,
and keeps serving (dtorch_core/worker/validate.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import dtorch_core as dt
from dtorch_core.ir.instructions import (
    Call,
    Collective,
    Constant,
    DefineMesh,
    DefineProgram,
    Fetch,
    MergedAllReduce,
    Put,
    Slot,
    Stats,
    WorkerFailure,
)
from dtorch_core.worker.loop import LocalPlan, Worker, _binder
from dtorch_core.worker.validate import PROTOCOL

from .helpers import assert_close


# ---------------------------------------------------------------------------------------------
# one worker, in this process
# ---------------------------------------------------------------------------------------------
class _NoExchange:
    world_size = 2


def _worker(rank=0):
    replies: list = []
    return Worker(rank, torch.device("cpu"), None, _NoExchange(), replies.append), replies


BAD = [
    (Collective("all_gather", 1, 5, 10, 11), "mesh dim 5 does not exist: mesh 1 has 1 dim", (11,)),
    (Collective("all_gather", 1, -1, 10, 11), "mesh dim -1 does not exist", (11,)),
    (Collective("all_gather", 9, 0, 10, 11), "mesh 9 is not defined", (11,)),
    (MergedAllReduce(1, 3, "sum", (10,), (12,)), "mesh dim 3 does not exist", (12,)),
    (Put(13, 1, {0: "not a tensor"}), "the shard for rank 0 is a str, not a tensor", (13,)),
    (DefineMesh(2, (2,), (0, 5)), "ranks [5] outside the world (ranks 0..1)", ()),
    (DefineMesh(2, (2, 2), (0, 1)), "needs 4 ranks, got 2", ()),
    (DefineMesh(2, (2,), (1, 1)), "names a rank twice", ()),
    (DefineProgram(3, (Put(14, 1, {0: 1}),), (), ()), "program 3: step 0: Put of tensor 14", ()),
    (DefineProgram(3, (Stats(1), 5), (), ()), "step 1 is a int", ()),
    (DefineProgram(3, (Constant(14, False),), (), ()), "step 0 names constant 14, which the program does not hold", ()),
    (DefineProgram(3, (Constant(14, True),), (), (), (), (Put(14, 1, {0: "x"}),)),
     "program 3: constant 0: Put of tensor 14", ()),
    (Call(1, ([1],), (15,)), "TypeError", (15,)),  # fails while it runs: unhashable tensor id
]


@pytest.mark.parametrize("ins, fragment, outputs", BAD, ids=[f"{type(i).__name__}-{f[:24]}" for i, f, _ in BAD])
def test_worker_rejects_reports_and_keeps_serving(ins, fragment, outputs):
    worker, replies = _worker()
    worker.run_batch([DefineMesh(1, (2,), (0, 1)), Put(10, 1, {0: torch.ones(2)})])
    worker.plans[1] = LocalPlan(torch.neg, _binder((Slot(0),), {}), "neg", False)
    worker.run_batch([ins, Fetch(10, 7, (0,))])  # the rest of the batch still runs
    protocol = [r for r in replies if r.request_id == PROTOCOL]
    assert len(protocol) == 1, replies
    failure = protocol[0].error
    assert type(failure) is WorkerFailure and failure.rank == 0
    assert fragment in failure.message and "rejected" in failure.message, failure.message
    assert "keeps serving" in failure.message
    fetched = [r for r in replies if r.request_id == 7]
    assert len(fetched) == 1 and torch.equal(fetched[0].value, torch.ones(2))
    for tid in outputs:
        assert worker.store[tid] is failure  # a read of an output says why


# ---------------------------------------------------------------------------------------------
# a real process runner session: a crafted batch submitted straight to the runner
# ---------------------------------------------------------------------------------------------
pytestmark_process = pytest.mark.skipif(
    "process" not in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process"),
    reason="process runner deselected by DTORCH_TEST_RUNNERS",
)


@pytest.fixture(scope="module")
def session():
    s = dt.init(world_size=2, runner="process")
    yield s
    dt.shutdown()


def _reports(fragment: str, ranks: int) -> None:
    """The next reads raise one WorkerError per rejecting rank, naming the problem; then none."""
    for _ in range(ranks):
        with pytest.raises(dt.WorkerError, match="rejected a batch") as info:
            dt.synchronize()
        assert fragment in str(info.value), str(info.value)
    dt.synchronize()


@pytestmark_process
@pytest.mark.parametrize(
    "make, fragment, ranks",
    [
        (lambda mid: Collective("all_gather", mid, 5, 0, 99_999), "mesh dim 5 does not exist", 2),
        (lambda mid: Put(99_998, mid, {0: "not a tensor"}), "the shard for rank 0 is a str, not a tensor", 1),
        (lambda mid: DefineMesh(77, (2,), (0, 5)), "ranks [5] outside the world (ranks 0..1)", 2),
    ],
    ids=["bad mesh dim", "Put of a non-tensor", "DefineMesh outside the world"],
)
def test_process_worker_rejects_a_bad_instruction_and_keeps_serving(session, make, fragment, ranks):
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(6, 3), mesh, [dt.Shard(0)])
    session.flush()
    t0 = time.monotonic()
    session.runner.submit([make(session.mesh_id(mesh))])
    _reports(fragment, ranks)
    assert_close(x + 1, x.full_tensor() + 1)  # both workers still serve
    assert all(p.poll() is None for p in session.runner.procs)
    assert time.monotonic() - t0 < 60
