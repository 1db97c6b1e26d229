"""The remote runner on loopback: `dtorch worker` subprocesses against dt.init(listen=...)."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from dtorch_zmq import frames
from dtorch_zmq.errors import AuthenticationError
from dtorch_zmq.keys import write_key
from torch import nn
from zmq_testing import LOOPBACK, RemoteSession, free_port, reap, start_workers

import dtorch_core as dt
from dtorch_core.errors import WorkerLostError


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_matmul_with_redistribute_on_uneven_shards(remote3):
    mesh = dt.init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(5, 4)  # 7 and 4 rows over 3 ranks: uneven
    da = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    db = dt.distribute_tensor(b, mesh, [dt.Shard(1)])
    out = da @ db.redistribute(mesh, [dt.Replicate()])
    close(out.full_tensor(), a @ b)
    close(out.redistribute(mesh, [dt.Shard(1)]).full_tensor(), a @ b)
    close((da.redistribute(mesh, [dt.Shard(1)]).sum(0)).full_tensor(), a.sum(0))


def test_linear_forward_backward_like_torch(remote3):
    mesh = dt.init_device_mesh("cpu", (3,))
    torch.manual_seed(1)
    ref = nn.Linear(6, 5)
    model = copy.deepcopy(ref)
    model.weight = nn.Parameter(dt.distribute_tensor(ref.weight.detach(), mesh, [dt.Shard(0)]))
    model.bias = nn.Parameter(dt.distribute_tensor(ref.bias.detach(), mesh, [dt.Shard(0)]))
    x, y = torch.randn(10, 6), torch.randn(10, 5)
    dx, dy = (dt.distribute_tensor(t, mesh, [dt.Shard(0)]) for t in (x, y))
    F.mse_loss(ref(x), y).backward()
    loss = F.mse_loss(model(dx), dy)
    loss.backward()
    close(loss.full_tensor(), F.mse_loss(ref(x), y).detach())
    close(model.weight.grad.full_tensor(), ref.weight.grad)
    close(model.bias.grad.full_tensor(), ref.bias.grad)


def test_a_large_tensor_round_trips_exactly(remote3):
    mesh = dt.init_device_mesh("cpu", (3,))
    torch.manual_seed(2)
    big = torch.randn(3001, 257)  # ~1 MiB per shard: far over the zero-copy threshold
    assert big.nbytes // 3 > frames.ZERO_COPY_BYTES
    d = dt.distribute_tensor(big, mesh, [dt.Shard(0)])
    big_copy = big.clone()
    big.add_(1.0)  # changing the source after the call must not change what the workers got
    assert torch.equal(d.full_tensor(), big_copy)
    assert torch.equal((d * 2).full_tensor(), big_copy * 2)


# before the tests below: they replace remote3's session with their own (dt.init)
def test_workers_report_the_per_op_path_they_run_in_their_hello(remote3):
    from dtorch_core.controller.session import current_session
    from dtorch_core.worker import native

    runner = current_session().runner
    # the workers run in this environment: what native.active() says here, they say too
    assert {runner._conns[r].native for r in range(3)} == {native.active()}
    mesh = dt.init_device_mesh("cpu", (3,))
    x = torch.arange(10.0)
    close((dt.distribute_tensor(x, mesh, [dt.Shard(0)]) * 2 + 1).full_tensor(), x * 2 + 1)


def test_env_form_and_a_wrong_key_is_refused_naming_the_peer(tmp_path, monkeypatch):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write_key(good)
    write_key(bad)
    address = f"tcp://{LOOPBACK}:{free_port()}"
    procs = start_workers(address, bad, [0])
    monkeypatch.setenv("DTORCH_RUNNER", "remote")
    monkeypatch.setenv("DTORCH_LISTEN", address)
    monkeypatch.setenv("DTORCH_KEY_FILE", good)
    start = time.monotonic()
    try:
        with pytest.raises(AuthenticationError, match=LOOPBACK) as info:
            dt.init(world_size=1, startup_timeout=60)
    finally:
        codes = reap(procs)
    took = time.monotonic() - start
    assert info.value.peer == LOOPBACK
    assert "HMAC" in str(info.value)
    assert took < 20, took  # seconds after the worker's start (mostly its imports), not the timeout
    assert codes == [4]  # the worker was told it was refused and exited


def test_a_killed_worker_raises_within_10s_and_shutdown_leaves_no_process(key_file):
    session = RemoteSession(2, key_file)
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(torch.arange(6.0), mesh, [dt.Shard(0)])
        close(x.full_tensor(), torch.arange(6.0))
        os.kill(session.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerLostError, match="rank 1"):
            (x + 1).full_tensor()
        assert time.monotonic() - killed < 10
    finally:
        dt.shutdown()
        codes = reap(session.procs)
    assert codes[1] == -signal.SIGKILL
