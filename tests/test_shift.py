"""The ``shift`` collective (member i receives member i + offset's tensor) and ``aten.roll`` by
whole shards, which plans as one shift: equal to torch's roll on every runner, eager and under
dt.compile, with no gather; the communicator between processes (comm/dist.py) over uneven
per-member shapes, its failure flag, and the wire encoding of the instruction. Also the padding
that lays uneven sequence shards out as equal blocks for a roll (F.pad at a sharded dim's end
pads each rank's shard, with no communication)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.comm.collectives import combine_all, combine_one
from dtorch_core.comm.dist import DistExchange
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Collective, WorkerFailure
from dtorch_core.worker.collectives import CollectiveStep

from .helpers import MESH_2D, WORLD_SIZE, P, S, assert_close, run_ranks

# (global shape, placements, shifts, dims): rolls by whole shards of an evenly sharded dim
ROLLS = [
    ((8, 3), (S(0),), 2, 0),                      # one shard forward
    ((8, 3), (S(0),), -2, 0),                     # one shard back
    ((3, 8), (S(1),), 6, 1),                      # three shards: offset 1 the other way
    ((8, 3), (S(0),), 16, 0),                     # whole turns: every rank keeps its shard
    ((4, 2, 5), (S(0),), -1, -3),                 # a negative dim
]
ROLLS_2D = [
    ((MESH_2D[1] * 2, 6), (S(1), S(0)), 2, 0),    # rolled over the second mesh dim, other dim sharded
    ((MESH_2D[0] * 3, 5), (S(0), P), -3, 0),      # a Partial on the other mesh dim passes through
    ((MESH_2D[0], MESH_2D[1] * 2, 3), (S(0), S(1)), (1, 2), (0, 1)),  # two dims: one shift each
]


def _roll_matches(mesh, shape, placements, shifts, dims, n_shifts):
    x = torch.randn(shape)
    d = dt.distribute_tensor(x, mesh, list(placements))
    with dt.debug.comm_mode() as comm:
        out = torch.roll(d, shifts, dims)
    assert comm.counts() == {"shift": n_shifts}, comm.counts()
    assert tuple(out.placements) == tuple(placements)
    assert_close(out.full_tensor(), torch.roll(d.full_tensor(), shifts, dims), rtol=0, atol=0)
    if not any(p == P for p in placements):
        assert torch.equal(out.full_tensor(), torch.roll(x, shifts, dims))


@pytest.mark.parametrize("case", ROLLS, ids=[str(c[2:]) for c in ROLLS])
def test_roll_by_whole_shards_is_one_shift(mesh1d, case):
    shape, placements, shifts, dims = case
    if WORLD_SIZE == 1:
        pytest.skip("one device: no shards to pass round (DTORCH_TEST_WORLD_SIZE=1 on one GPU)")
    if shape[dims] % WORLD_SIZE:
        pytest.skip("written for a dim the mesh divides")
    _roll_matches(mesh1d, shape, placements, shifts, dims, 1)


@pytest.mark.parametrize("case", ROLLS_2D, ids=[str(c[2:]) for c in ROLLS_2D])
def test_roll_on_a_2d_mesh(mesh2d, case):
    shape, placements, shifts, dims = case
    _roll_matches(mesh2d, shape, placements, shifts, dims, 2 if isinstance(dims, tuple) else 1)


def test_other_rolls_keep_torch_values(mesh1d):
    """A roll by part of a shard, of an uneven dim or of an unsharded dim is the roll rule's:
    exact, gathering the rolled dim where it is sharded."""
    x = torch.randn(7, 4)
    d = dt.distribute_tensor(x, mesh1d, [dt.Shard(0)])
    for shifts, dims in ((1, 0), (2, 0), (3, 1), (-5, 1)):
        assert torch.equal(torch.roll(d, shifts, dims).full_tensor(), torch.roll(x, shifts, dims))


def test_roll_gradient_is_the_shift_back(mesh1d):
    x = torch.randn(2 * WORLD_SIZE, 3, requires_grad=True)
    w = torch.randn(2 * WORLD_SIZE, 3)
    d = dt.distribute_tensor(x.detach(), mesh1d, [dt.Shard(0)]).requires_grad_()
    with dt.debug.comm_mode() as comm:
        (torch.roll(d, 2, 0) * dt.distribute_tensor(w, mesh1d, [dt.Shard(0)])).sum().backward()
    (torch.roll(x, 2, 0) * w).sum().backward()
    assert comm.counts().get("shift") == 2 and "all_gather" not in comm.counts(), comm.counts()
    assert torch.equal(d.grad.full_tensor(), x.grad)


def test_roll_in_a_compiled_step_replays(mesh1d):
    def step(x):
        return torch.roll(x, 2, 0) * 2 + torch.roll(x, -4, 0)

    compiled = dt.compile(step)
    for i in range(4):
        x = torch.randn(4 * WORLD_SIZE, 3)
        out = compiled(dt.distribute_tensor(x, mesh1d, [dt.Shard(0)]))
        assert torch.equal(out.full_tensor(), step(x)), i
    assert compiled.replays > 0


def test_combine_gives_each_member_its_source_over_uneven_shapes():
    values = [torch.randn(n, 2) for n in (3, 3, 1, 0)]
    for offset in (1, -1, 2, 4, 0):
        results = combine_all("shift", values, 0, "sum", 0, offset)
        for i, r in enumerate(results):
            source = values[(i + offset) % 4]
            assert torch.equal(r, source) and r.data_ptr() != source.data_ptr() or source.numel() == 0
            assert torch.equal(combine_one("shift", values, 0, "sum", 0, i, offset), source)


def test_shift_travels_on_the_wire():
    ins = Collective("shift", 1, 0, 4, 5, shapes=((2, 3), (1, 3)), dtype=torch.float32, offset=-1)
    assert wire.decode(wire.encode([ins])) == [ins]


@pytest.mark.parametrize("length", [5, 7, 9, 21, 1, 8])
def test_end_padding_of_uneven_shards_stays_local(mesh, length):
    """Padding an uneven sequence to parts x ceil(length / parts) and cropping it back: every
    rank pads or crops its own shard (torch.chunk puts the padded chunks where the old ones
    were), nothing moves, gradients included; a pad that would need data moved still gathers."""
    sp = mesh.ndim - 1
    parts = mesh.size(sp)
    padded = parts * -(-length // parts)
    placements = [dt.Shard(2)] * mesh.ndim
    placements[sp] = dt.Shard(1)
    x = torch.randn(1, length, 4, 2, requires_grad=True)
    d = dt.distribute_tensor(x.detach(), mesh, placements).requires_grad_()
    with dt.debug.comm_mode() as comm:
        y = F.pad(d, (0, 0, 0, 0, 0, padded - length))
        z = F.pad(y * 2, (0, 0, 0, 0, 0, length - padded))
        z.sum().backward()
    assert not comm.events, comm.counts()
    assert tuple(y.placements) == tuple(z.placements) == tuple(placements)
    assert torch.equal(y.full_tensor(), F.pad(x, (0, 0, 0, 0, 0, padded - length)))
    assert torch.equal(z.full_tensor(), 2 * x)
    assert torch.equal(d.grad.full_tensor(), torch.full_like(x, 2.0))
    for pad in ((0, 0, 0, 0, 1, 0), (0, 0, 0, 0, 0, padded - length + parts)):
        assert torch.equal(F.pad(d, pad).full_tensor(), F.pad(x, pad)), pad


# -- DistExchange between real processes ----------------------------------------------------------
WORLD = 4
# (per-member shapes, dtype, offset)
DIST_CASES = [
    (((3, 2), (3, 2), (1, 2), (0, 2)), torch.float32, 1),
    (((3, 2), (3, 2), (1, 2), (0, 2)), torch.float32, -1),
    (((2,), (5,), (1,), (4,)), torch.float64, 2),
    (((2, 2),) * 4, torch.bool, 3),
    (((2, 2),) * 4, torch.bfloat16, 0),
]


def _value(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) > 0) if dtype is torch.bool else torch.randn(shape, generator=g).to(dtype)


def _run_dist(rank: int) -> None:
    ex = DistExchange(rank, torch.device("cpu"))
    ex.define_mesh(0, (WORLD,), tuple(range(WORLD)))
    for n, (shapes, dtype, offset) in enumerate(DIST_CASES):
        ins = Collective("shift", 0, 0, 1, 2, shapes=shapes, dtype=dtype, offset=offset)
        got = ex.exchange((0, 0, 0, n), rank, WORLD, _value(10 * n + rank, shapes[rank], dtype), CollectiveStep(ins, rank))
        source = (rank + offset) % WORLD
        assert torch.equal(got, _value(10 * n + source, shapes[source], dtype)), (n, rank)
    # a failed contribution: its receiver fails (the flag travels), the others get their values
    shapes = ((2,),) * WORLD
    ins = Collective("shift", 0, 0, 1, 2, shapes=shapes, dtype=torch.float32, offset=1)
    failure = WorkerFailure(2, "aten.mm.default", None, "boom")
    mine = failure if rank == 2 else torch.full((2,), float(rank))
    got = ex.exchange((0, 0, 0, 99), rank, WORLD, mine, CollectiveStep(ins, rank))
    if rank == 2:
        assert got is failure
    elif rank == 1:
        assert type(got) is WorkerFailure and "a peer in group" in got.message, got
    else:
        assert torch.equal(got, torch.full((2,), float((rank + 1) % WORLD)))


def _entry(rank: int, store_file: str, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
        try:
            _run_dist(rank)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_dist_shift_over_uneven_shapes_between_processes(tmp_path):
    run_ranks(_entry, lambda r: (r, str(tmp_path / "store")), WORLD)

