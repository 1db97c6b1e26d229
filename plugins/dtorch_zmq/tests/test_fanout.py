"""One copy per node: simulated nodes on 127.0.0.1 (DTORCH_NODE_ID per worker), against plain
torch and against the one-copy-per-worker path (DTORCH_FANOUT=0)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from dtorch_zmq import fanout
from dtorch_zmq import frames as fr
from zmq_testing import LOOPBACK, free_port, reap, start_workers

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.errors import WorkerLostError
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, DefinePlan, DefineProgram, Delete, Put
from dtorch_core.runners.process import for_rank


class Session:
    """``world`` `dtorch worker` processes; rank r reports node ``nodes[r]``."""

    def __init__(self, key_file: str, nodes: list[str], fanout_on: bool = True, **options):
        self.address = f"tcp://{LOOPBACK}:{free_port()}"
        self.procs = []
        for rank, node in enumerate(nodes):
            env = dict(os.environ, DTORCH_NODE_ID=node)
            self.procs += start_workers(self.address, key_file, [rank], env=env)
        try:
            dt.init(world_size=len(nodes), runner="remote", listen=self.address, key_file=key_file,
                    startup_timeout=60, fanout=fanout_on, **options)
        except BaseException:
            for p in self.procs:
                p.kill()
            raise
        self.endpoint = current_session().runner.endpoint

    def close(self) -> list:
        dt.shutdown()
        return reap(self.procs)


def compute(world: int) -> dict:
    """Uneven shards (Puts of per-rank shards), redistributes, a backward: the results."""
    mesh = dt.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(5, 6)
    w = torch.randn(6, 3, requires_grad=True)
    da = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    db = dt.distribute_tensor(b, mesh, [dt.Shard(1)])
    dw = torch.nn.Parameter(dt.distribute_tensor(w.detach(), mesh, [dt.Replicate()]))
    out = da @ db.redistribute(mesh, [dt.Replicate()])
    loss = (out @ dw).square().mean()
    loss.backward()
    (a @ b @ w).square().mean().backward()
    got = {"out": out.full_tensor(), "loss": loss.full_tensor(), "grad": dw.grad.full_tensor()}
    want = {"out": a @ b, "loss": (a @ b @ w).square().mean().detach(), "grad": w.grad}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)
    return got


def batch_bytes(world: int) -> int:
    """Bytes the controller sends for one batch of 300 small instructions (deletes of no tensor)."""
    dt.synchronize()
    runner = current_session().runner
    before = runner.endpoint.batch_bytes
    runner.submit([Delete((1_000_000 + i,)) for i in range(300)])
    sent = runner.endpoint.batch_bytes - before
    mesh = dt.init_device_mesh("cpu", (world,))  # the workers still answer, in order
    assert torch.equal(dt.distribute_tensor(torch.ones(world), mesh, [dt.Shard(0)]).full_tensor(), torch.ones(world))
    return sent


@pytest.fixture(scope="module")
def results(key_file):
    """The same programs with two nodes of two workers, then with one copy per worker."""
    out = {}
    session = Session(key_file, ["a", "a", "b", "b"])
    try:
        out["nodes"] = sorted((c.rank, c.leader, c.followers) for c in session.endpoint.by_rank.values())
        out["fanout"] = compute(4)
        out["fanout bytes"] = batch_bytes(4)
        torch.manual_seed(3)
        big = torch.randn(1024, 257)  # 1 MiB over 4 ranks: zero-copy shard frames
        endpoint = session.endpoint
        before = endpoint.batch_bytes
        d = dt.distribute_tensor(big, dt.init_device_mesh("cpu", (4,)), [dt.Shard(0)])
        dt.synchronize()
        out["put bytes"] = endpoint.batch_bytes - before
        out["big"] = (big, d.full_tensor())
    finally:
        assert session.close() == [0, 0, 0, 0]
    session = Session(key_file, ["a", "a", "b", "b"], fanout_on=False)
    try:
        out["per worker"] = compute(4)
        out["per worker bytes"] = batch_bytes(4)
    finally:
        assert session.close() == [0, 0, 0, 0]
    return out


def test_two_nodes_elect_their_lowest_ranks(results):
    assert results["nodes"] == [(0, None, (1,)), (1, 0, ()), (2, None, (3,)), (3, 2, ())]


def test_results_equal_torch_and_the_one_copy_per_worker_path(results):
    for name, value in results["fanout"].items():
        assert torch.equal(value, results["per worker"][name]), name
    big, back = results["big"]
    assert torch.equal(back, big)


def test_bytes_per_batch_follow_nodes_not_workers(results):
    # 4 workers on 2 nodes: the same frame to 2 leaders instead of 4 workers
    assert results["per worker bytes"] == 2 * results["fanout bytes"] > 300 * 3
    # a Put's shards go to their own node only: about one copy of the tensor in all
    nbytes = 1024 * 257 * 4
    assert nbytes <= results["put bytes"] < nbytes * 1.02, results["put bytes"]


def test_rank_parts_rebuild_exactly_what_each_rank_would_get():
    shards = {r: torch.full((r + 1, 2), float(r)) for r in range(3)}
    batch = [
        Put(1, 0, dict(shards)),
        Call(7, (1,), (2,), ("f.py", 3)),
        DefinePlan(9, 0, "aten.add.Tensor", (1,), {}, {0: ((1,), {}), 2: ((2,), {"alpha": 2})}, "add"),
        DefineProgram(4, (Call(7, (1,), (3,)),), (1,), (3,), (), (Put(5, 0, {1: shards[1]}), Put(6, 0, dict(shards)))),
        Put(8, 0, {2: shards[2]}),
    ]
    assert fanout.has_rank_parts(batch) and not fanout.has_rank_parts(batch[1:2])
    common, parts = fanout.split_batch(batch)
    common_bytes = wire.encode(common)
    for rank in range(3):
        message = fanout.ranked_message(common_bytes, wire.encode(parts[rank]))
        assert wire.encode(fanout.decode_local(message, rank)) == wire.encode(for_rank(batch, rank))
    # a node's frame: the common batch once, then each of its ranks' parts
    ranked = [(r, fanout.encoded_frames(parts[r])) for r in (1, 2)]
    frames = fanout.node_parts(fanout.encoded_frames(common), ranked)
    got_common, by_rank = fanout.parse_node_parts(frames)
    assert bytes(fr.joined(got_common)) == common_bytes and sorted(by_rank) == [1, 2]
    with pytest.raises(wire.WireError, match="does not match"):
        fanout.parse_node_parts(frames[:-1])
    with pytest.raises(wire.WireError, match="names instruction"):
        fanout.merge_part(wire.decode(common_bytes), {99: None}, 0)


def test_a_killed_follower_is_a_typed_error_naming_it(key_file):
    session = Session(key_file, ["a", "a", "a"])
    try:
        mesh = dt.init_device_mesh("cpu", (3,))
        x = dt.distribute_tensor(torch.arange(6.0), mesh, [dt.Shard(0)])
        assert torch.equal(x.full_tensor(), torch.arange(6.0))
        os.kill(session.procs[2].pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerLostError, match="rank 2.*reported by its node leader, rank 0"):
            (x + 1).full_tensor()
        assert time.monotonic() - killed < 10
    finally:
        dt.shutdown()
        codes = reap(session.procs)
    assert codes[:2] == [0, 0] and codes[2] == -signal.SIGKILL


def test_a_killed_leader_is_a_typed_error_and_its_followers_exit(key_file):
    session = Session(key_file, ["a", "a", "b"], heartbeat_timeout=2.0)
    try:
        mesh = dt.init_device_mesh("cpu", (3,))
        x = dt.distribute_tensor(torch.arange(6.0), mesh, [dt.Shard(0)])
        assert torch.equal(x.full_tensor(), torch.arange(6.0))
        os.kill(session.procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerLostError, match="rank 0"):
            (x + 1).full_tensor()
        assert time.monotonic() - killed < 10
        # its follower (rank 1) sees the leader's channels close and exits by itself
        assert session.procs[1].wait(10) == 3
    finally:
        dt.shutdown()
        codes = reap(session.procs)
    assert codes[0] == -signal.SIGKILL and codes[2] == 0
