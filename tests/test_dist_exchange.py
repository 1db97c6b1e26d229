"""DistExchange (comm/dist.py) between real processes: its payload paths against combine_one.

Four gloo processes on 127.0.0.1 run every communicating kind over uneven shapes, through the
all-gather path (CPU's, bit-identical to the in-process runners), CPU's path for large payloads
(flags first, then the payload alone; all-reduce in chunks; bit-identical too: ``split_bytes=0``
sends every case there) and the native path (the one NCCL takes on GPUs; gloo can run it too).
A failed contribution must not hang its peers and must leave the failed rank poisoned.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from dtorch_core.comm.collectives import combine_one
from dtorch_core.comm.dist import DistExchange
from dtorch_core.spec import local_shapes
from dtorch_core.ir.instructions import Collective, DefineMesh, Fetch, MergedAllReduce, Reply, Stats, WorkerFailure
from dtorch_core.placement import Partial, Replicate, Shard
from dtorch_core.worker.loop import CollectiveStep, Worker

from .helpers import run_ranks

WORLD = 4
MESH_1D = (0, (4,))
MESH_2D = (1, (2, 2))
# (mesh, kind, source placements, tensor dim, dim2, reduce op, global shape)
CASES = [
    (MESH_1D, "all_gather", (Shard(0),), 0, 0, "sum", (7, 3)),  # 2, 2, 2, 1 rows
    (MESH_1D, "all_gather", (Shard(1),), 1, 0, "sum", (3, 6, 2)),  # 2, 2, 2, 0 columns
    (MESH_1D, "all_gather", (Shard(0),), 0, 0, "sum", (8, 5)),  # even
    (MESH_1D, "all_reduce", (Partial(),), 0, 0, "sum", (5, 3)),
    (MESH_1D, "all_reduce", (Partial("avg"),), 0, 0, "avg", (4,)),
    (MESH_1D, "all_reduce", (Partial("max"),), 0, 0, "max", (2, 3)),
    (MESH_1D, "reduce_scatter", (Partial(),), 0, 0, "sum", (7, 2)),
    (MESH_1D, "reduce_scatter", (Partial(),), 1, 0, "sum", (3, 9)),
    (MESH_1D, "reduce_scatter", (Partial("avg"),), 0, 0, "avg", (8, 3)),
    (MESH_1D, "all_to_all", (Shard(0),), 0, 1, "sum", (7, 5)),
    (MESH_1D, "all_to_all", (Shard(1),), 1, 0, "sum", (6, 3, 2)),
    (MESH_1D, "all_to_all", (Shard(0),), 0, 1, "sum", (8, 4)),  # even
    (MESH_1D, "all_to_all", (Shard(2),), 2, 0, "sum", (4, 3, 8)),  # even, dim after dim2
    (MESH_2D, "all_gather", (Shard(0), Shard(0)), 0, 0, "sum", (9, 2)),  # nested uneven shards
    (MESH_2D, "reduce_scatter", (Replicate(), Partial()), 1, 0, "sum", (2, 5)),
    (MESH_2D, "all_reduce", (Replicate(), Partial()), 0, 0, "sum", (3, 5)),  # two members
    (MESH_2D, "all_reduce", (Replicate(), Partial("avg")), 0, 0, "avg", (7,)),
    (MESH_2D, "all_reduce", (Replicate(), Partial("max")), 0, 0, "max", (2, 3)),
    (MESH_2D, "all_to_all", (Shard(1), Shard(0)), 0, 1, "sum", (5, 7)),
]


def _contribution(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _exchange(rank: int, mode: str) -> DistExchange:
    ex = DistExchange(rank, torch.device("cpu"), native=mode == "native")
    if mode == "large":
        ex.split_bytes = 0
    return ex


def _run_cases(rank: int, mode: str) -> None:
    native = mode == "native"
    ex = _exchange(rank, mode)
    ranks = tuple(range(WORLD))
    for mesh_id, shape in (MESH_1D, MESH_2D):
        ex.define_mesh(mesh_id, shape, ranks)
    for n, ((mesh_id, mesh_shape), kind, placements, dim, dim2, op, global_shape) in enumerate(CASES):
        shapes = local_shapes(global_shape, placements, mesh_shape)
        mesh_dim = len(mesh_shape) - 1  # the last mesh dim: groups of members with consecutive ranks
        ins = Collective(kind, mesh_id, mesh_dim, 1, 2, dim, op, dim2, shapes, torch.float32)
        size = mesh_shape[mesh_dim]
        first = rank - rank % size
        members = list(range(first, first + size))
        values = [_contribution(100 * n + r, shapes[r]) for r in members]
        index = members.index(rank)
        step = CollectiveStep(ins, rank)
        got = ex.exchange((mesh_id, mesh_dim, first // size, n), index, size, values[index], step)
        expected = combine_one(kind, values, dim, op, dim2, index)
        assert got.shape == expected.shape, (n, kind, got.shape, expected.shape)
        if native:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=f"case {n} {kind}")
        else:
            assert torch.equal(got, expected), (n, kind)
        got.add_(1)  # a result is a tensor of its own
        assert torch.equal(values[index], _contribution(100 * n + rank, shapes[rank]))

    # a failed contribution never leaves its peers waiting; the failed member gets its failure back.
    # All-gather path (CPU): a flag travels with the payloads and the step fails for everyone.
    # Native path: nothing tells the peers, who go on with zeros; the failed member stays poisoned
    shapes = local_shapes((8, 2), (Shard(0),), (4,))
    ins = Collective("all_gather", 0, 0, 1, 2, 0, "sum", 0, shapes, torch.float32)
    failure = WorkerFailure(2, "aten.mm.default", ("user.py", 7), "boom")
    mine = failure if rank == 2 else torch.full(shapes[rank], float(rank))
    got = ex.exchange((0, 0, 0, 99), rank, WORLD, mine, CollectiveStep(ins, rank))
    if rank == 2:
        assert got is failure
        if native:
            assert "boom" in ex.poisoned.message and "restart" in ex.poisoned.message
    elif native:
        expected = torch.cat([torch.full((2, 2), float(r)) if r != 2 else torch.zeros(2, 2) for r in range(WORLD)])
        assert torch.equal(got, expected)
    else:
        assert type(got) is WorkerFailure and "a peer in group" in got.message, got
    if not native or rank != 2:
        assert ex.poisoned is None
    # and the group keeps working
    ok = ex.exchange((0, 0, 0, 100), rank, WORLD, torch.full(shapes[rank], 1.0), CollectiveStep(ins, rank))
    assert torch.equal(ok, torch.ones(8, 2))


def _run_merged(rank: int, mode: str) -> None:
    """A MergedAllReduce of float32 and float64 gradients where one rank's float64 source failed:
    every rank makes one exchange per dtype (the failed one too, from the instruction's dtypes),
    so nobody waits forever; the float32 sums are whole everywhere, the failed rank gets its
    failure for the float64 one, its peers a failure too (all-gather path) or a sum with zeros in
    its place (native path, where the failed rank is poisoned instead)."""
    native = mode == "native"
    worker = Worker(rank, torch.device("cpu"), kernels=None, exchange=_exchange(rank, mode), reply=lambda r: None)
    worker.execute(DefineMesh(7, (WORLD,), tuple(range(WORLD))))
    shapes_of = [(3, 2), (5,), (4,)]
    dtypes = (torch.float32, torch.float64, torch.float32)
    values = {r: [_contribution(10 * r + i, s, d) for i, (s, d) in enumerate(zip(shapes_of, dtypes))] for r in range(WORLD)}
    for i, v in enumerate(values[rank]):
        worker.store[100 + i] = v
    failure = WorkerFailure(1, "aten.mul.default", None, "boom")
    if rank == 1:
        worker.store[101] = failure
    shapes = tuple(tuple(shapes_of) for _ in range(WORLD))
    worker.execute(MergedAllReduce(7, 0, "sum", (100, 101, 102), (200, 201, 202), shapes, dtypes))
    for i in range(3):
        got = worker.store[200 + i]
        if rank == 1 and dtypes[i] == torch.float64:
            assert got is failure, (i, got)
            continue
        if not native and dtypes[i] == torch.float64:
            assert type(got) is WorkerFailure and "a peer in group" in got.message, (i, got)
            continue
        expected = sum(values[r][i] for r in range(WORLD) if r != 1 or dtypes[i] != torch.float64)
        torch.testing.assert_close(got, expected, msg=f"source {i}")


def _entry(rank: int, store_file: str, mode: str, errors) -> None:
    try:
        # a file store, as the process runner uses: no port to race for
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
        try:
            _run_cases(rank, mode)
            _run_merged(rank, mode)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("mode", ["gathered", "large", "native"])
def test_every_kind_over_uneven_shards_between_processes(mode, tmp_path):
    run_ranks(_entry, lambda r: (r, str(tmp_path / "store"), mode), WORLD)


class _Poisoned:
    poisoned = WorkerFailure(1, "aten.mm.default", ("user.py", 3), "boom (restart the session)")


def test_a_poisoned_worker_answers_every_fetch_and_stats_with_its_failure():
    replies = []
    worker = Worker(1, torch.device("cpu"), kernels=None, exchange=_Poisoned(), reply=replies.append)
    worker.store[5] = torch.ones(2)
    worker.execute(Fetch(5, 1, (0,), everyone=True))  # not asked for a value: still reports
    worker.execute(Fetch(5, 2, (1,)))
    worker.execute(Stats(3))
    assert [r.request_id for r in replies] == [1, 2, 3]
    assert all(r.error is _Poisoned.poisoned for r in replies)


def test_a_healthy_worker_answers_a_fetch_for_everyone_with_nothing():
    replies = []
    worker = Worker(1, torch.device("cpu"), kernels=None, exchange=object(), reply=replies.append)
    worker.execute(Fetch(5, 1, (0,), everyone=True))
    worker.execute(Fetch(5, 2, (0,)))  # not asked, not everyone: no reply
    assert replies == [Reply(1, 1)]


def test_hints_are_every_ranks_local_shape_in_rank_order():
    assert local_shapes((7, 3), (Shard(0),), (4,)) == ((2, 3), (2, 3), (2, 3), (1, 3))
    # nested shards: dim 0 split over mesh dim 0, then each half over mesh dim 1
    assert local_shapes((9,), (Shard(0), Shard(0)), (2, 2)) == ((3,), (2,), (2,), (2,))
    assert local_shapes((4, 4), (Replicate(), Partial()), (2, 2)) == ((4, 4),) * 4
