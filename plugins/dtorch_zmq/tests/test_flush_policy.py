"""The remote runner's flush policy follows the messages a batch takes (nodes, or workers without
fanout); results stay torch's, sync points still flush at once, faults stay typed errors."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from dtorch_zmq import runner as remote
from test_fanout import Session
from zmq_testing import reap

import dtorch_core as dt
from dtorch_core.controller.session import FlushPolicy, current_session
from dtorch_core.errors import WorkerLostError


def test_batches_and_timer_grow_with_the_messages_past_a_small_mesh():
    base = remote.BASE_FLUSH_POLICY
    for messages in (1, 8, remote.SMALL_MESH):
        assert remote.flush_policy_for(messages) == base
    for messages in (2 * remote.SMALL_MESH, 4 * remote.SMALL_MESH, 3 * remote.SMALL_MESH // 2):
        scale = messages / remote.SMALL_MESH
        policy = remote.flush_policy_for(messages)
        assert policy.batch_size == round(base.batch_size * scale)
        assert policy.interval == pytest.approx(base.interval * scale)
        assert policy.first_batch == base.first_batch  # after a sync point the first batch still leaves small
        assert policy.when_idle  # while the controller keeps issuing, only the size ends a batch
    largest = remote.flush_policy_for(remote.MAX_SCALE * remote.SMALL_MESH)
    assert remote.flush_policy_for(100 * remote.MAX_SCALE * remote.SMALL_MESH) == largest


def uneven_compute(world: int) -> None:
    """Uneven shards (7 rows over ``world``), a matmul, a redistribute and a reduction, against torch."""
    mesh = dt.init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    a, b = torch.randn(7, 5), torch.randn(5, 3)
    da = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    db = dt.distribute_tensor(b, mesh, [dt.Replicate()])
    out = da @ db
    for _ in range(40):  # more than one batch's worth of small ops
        out = out * 0.5 + 1
    want = a @ b
    for _ in range(40):
        want = want * 0.5 + 1
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(out.redistribute(mesh, [dt.Replicate()]).to_local(), want)
    torch.testing.assert_close(out.sum().full_tensor(), want.sum())


def test_the_policy_for_two_nodes_gives_torch_s_results_and_a_lost_worker_stays_typed(key_file, monkeypatch):
    monkeypatch.setattr(remote, "SMALL_MESH", 1)  # two nodes already past the small mesh
    session = Session(key_file, ["a", "a", "b"])
    try:
        runner = current_session().runner
        assert runner.messages_per_batch == 2
        assert runner.flush_policy == remote.flush_policy_for(2)
        assert current_session().batch_size == 2 * remote.BASE_FLUSH_POLICY.batch_size
        uneven_compute(3)
        x = dt.distribute_tensor(torch.arange(7.0), dt.init_device_mesh("cpu", (3,)), [dt.Shard(0)])
        os.kill(session.procs[1].pid, signal.SIGKILL)  # a follower of node a
        killed = time.monotonic()
        with pytest.raises(WorkerLostError, match="rank 1"):
            (x + 1).full_tensor()
        assert time.monotonic() - killed < 10
    finally:
        dt.shutdown()
        codes = reap(session.procs)
    assert codes[0] == 0 and codes[2] == 0 and codes[1] == -signal.SIGKILL


def test_sync_points_flush_at_once_whatever_the_policy(key_file, monkeypatch):
    asked = []

    def only_sync_points(messages):  # no batch leaves but at a sync point
        asked.append(messages)
        return FlushPolicy(batch_size=10**6, interval=60.0, first_batch=10**6)

    monkeypatch.setattr(remote, "flush_policy_for", only_sync_points)
    session = Session(key_file, ["a", "a", "b"], fanout_on=False)
    try:
        assert asked == [3]  # one copy per worker: a batch is a message per worker
        uneven_compute(3)
        endpoint = current_session().runner.endpoint
        x = dt.distribute_tensor(torch.arange(7.0), dt.init_device_mesh("cpu", (3,)), [dt.Shard(0)])
        dt.synchronize()
        sent = endpoint.batches_sent
        for _ in range(50):
            x = x + 1
        time.sleep(0.1)
        assert endpoint.batches_sent == sent  # the ops wait: neither size nor timer flushed them
        start = time.monotonic()
        torch.testing.assert_close(x.full_tensor(), torch.arange(7.0) + 50)
        assert time.monotonic() - start < 5  # the read sent them at once, not after the 60 s timer
    finally:
        assert session.close() == [0, 0, 0]
