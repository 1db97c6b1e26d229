"""Collectives between worker processes through torch.distributed.

The members of a group must agree on every contribution's size before payloads move. The
controller knows them all, so its instructions carry every rank's local shape and the dtype
(``Collective.shapes``/``dtype``, planner/emit.py) and the payloads move with no header exchange:

- on CPU (gloo) an all-gather or all-reduce is one all-gather of the contributions (padded to
  the largest) followed by the ``combine_all`` arithmetic of the in-process runners, so every
  runner computes the same bits; an all-to-all or reduce-scatter is one ``all_to_all_single``
  that sends each member only the pieces its result needs, then the same arithmetic on them;
  from ``SPLIT_BYTES`` a member, the flags go first and the payload moves alone (``_LARGE``);
- a ``shift`` (each member receives one peer's tensor) is one point-to-point send and receive
  per member (``batch_isend_irecv``) on every device type: no member receives more than its
  own result;
- on devices (NCCL) each kind runs as the matching torch.distributed collective
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``),
  padded where shards are uneven, on the caller's current stream (the worker's communication
  stream). Reductions then run in the library's order, not group order.

A member whose contribution failed (an earlier kernel failed on it) still takes part, with zeros
of the expected shape, so its peers never wait for it. On CPU a flag byte behind each payload
tells every member, and the step fails for all of them (as on the in-process runners). A native
collective carries no flag (reading one would wait for the device): the failed member keeps its
failure as ``poisoned`` and every later Fetch or Stats reply carries it (the controller asks every
rank, see ``Session.fetch``), since its peers went on with zeros in its place. Every
communicating instruction carries the shapes: the process runner sets ``collective_hints``, and
wire messages of older controllers (without shapes) are refused by the version check.
"""

from __future__ import annotations

import itertools
import math
import os

import attrs
import torch
import torch.distributed as dist

from ..ir.instructions import WorkerFailure
from ..mesh import DeviceMesh
from ..placement import chunk_extent
from .collectives import chunk_of, reduce_all

_NATIVE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                            torch.int8, torch.uint8})
# torch 2.13 renamed these (the old names warn); 2.11 has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# CPU: from this many bytes of the largest contribution, payloads move without flag slots (the
# flags go first, one byte each) and an all-reduce is a reduce-scatter then an all-gather
SPLIT_BYTES = 1 << 18


@attrs.define
class DistExchange:
    """The exchange interface of :class:`~dtorch_core.worker.loop.Worker` over process groups."""

    rank: int
    device: torch.device
    groups: dict = attrs.field(factory=dict)  # (mesh_id, mesh_dim, group index) -> (group, members)
    positions: dict = attrs.field(factory=dict)  # mesh_id -> {rank: position in the mesh's rank order}
    poisoned: WorkerFailure | None = None
    # whether collectives run as the backend's own (devices) or as all-gathers (CPU);
    # DTORCH_NATIVE_COLLECTIVES=1 takes the native path on CPU too (gloo), to test it without GPUs
    native: bool = attrs.field()
    split_bytes: int = SPLIT_BYTES  # from this size, the paths of ``_LARGE`` (below)

    @native.default
    def _native_default(self) -> bool:
        return self.device.type != "cpu" or os.environ.get("DTORCH_NATIVE_COLLECTIVES") == "1"

    def define_mesh(self, mesh_id: int, shape, ranks) -> None:
        """Create one process group per group of every mesh dim (every rank must call this)."""
        root = DeviceMesh("worker", tuple(shape), tuple(ranks))
        self.positions[mesh_id] = {r: i for i, r in enumerate(ranks)}
        for d in range(len(shape)):
            for gi, members in enumerate(root.groups(d)):
                group = dist.new_group(list(members)) if len(members) > 1 else None
                if self.rank in members:
                    self.groups[(mesh_id, d, gi)] = (group, members)

    def exchange(self, key, index: int, size: int, value, compute):
        if size == 1:
            return compute([value])[0]
        group, members = self.groups[key[:3]]
        ins = compute.ins
        where = self.positions[ins.mesh_id]
        shapes = [tuple(ins.shapes[where[m]]) for m in members]
        failure = value if type(value) is WorkerFailure else None
        owned = getattr(compute, "owned", False) and failure is None  # the result may be built in ``value``
        if failure is not None:
            value = torch.zeros(shapes[index], dtype=ins.dtype, device=self.device)
        if ins.kind == "shift":
            result, peers_failed = _shift(members, group, index, shapes, ins.offset, value, failure is not None)
        elif self.native and ins.dtype in _NATIVE_DTYPES:
            result = _NATIVE[ins.kind](ins, group, index, shapes, value, owned)
            peers_failed = None  # no flags travel with a native collective
        elif ins.kind in _LARGE and ins.dtype in _NATIVE_DTYPES and \
                max(map(math.prod, shapes)) * value.element_size() >= self.split_bytes:
            result, peers_failed = _LARGE[ins.kind](ins, group, index, shapes, value, failure is not None, owned)
        elif ins.kind in _BY_PIECES:
            result, peers_failed = _BY_PIECES[ins.kind](ins, group, index, shapes, value, failure is not None)
        else:
            values, peers_failed = _all_gather_padded(group, index, shapes, value, self.device, failure is not None)
            result = None if peers_failed else compute.one(values, index, value if owned else None)
        if failure is not None:
            if peers_failed is None:
                self._poison(failure, ins.kind)
            return failure
        if peers_failed:
            return WorkerFailure(self.rank, "collective", None, f"a peer in group {members} failed before this collective")
        return result

    def _poison(self, failure: WorkerFailure, kind: str) -> None:
        if self.poisoned is None:
            self.poisoned = WorkerFailure(
                failure.rank, failure.op, failure.source,
                f"{failure.message} (the peers of rank {self.rank} then went on with zeros in place of its {kind} "
                "contribution, so values computed since are not reliable: restart the session)")


def _all_gather_padded(group, index, shapes, value, device, failed: bool) -> tuple[list, bool | None]:
    """Every member's contribution (of ``shapes``), through one all-gather of padded bytes, and
    whether a member's contribution failed: a flag byte travels behind each payload, read where
    reading it costs nothing (CPU; None elsewhere)."""
    itemsize = value.element_size()
    sizes = [math.prod(s) for s in shapes]
    width = (max(sizes) + 1) * itemsize  # bytes; the flag's slot keeps every payload aligned for its dtype
    mine_bytes = torch.empty(width, dtype=torch.uint8, device=device)
    if sizes[index]:
        mine_bytes.view(value.dtype).narrow(0, 0, sizes[index]).view(value.shape).copy_(value)  # one pass
    mine_bytes[-1] = int(failed)
    gathered_bytes = torch.empty((len(shapes), width), dtype=torch.uint8, device=device)
    _all_gather_single(gathered_bytes.view(-1), mine_bytes, group=group)
    gathered = gathered_bytes.view(value.dtype)
    values = [gathered.select(0, i).narrow(0, 0, n).view(s) for i, (n, s) in enumerate(zip(sizes, shapes))]
    return values, bool(gathered_bytes.select(1, width - 1).any()) if device.type == "cpu" else None


def _all_to_all_flagged(group, sends, recv_shapes, largest: int, like, failed: bool) -> tuple[list, bool | None]:
    """The pieces of shapes ``recv_shapes`` that the members send this one (``sends[j]`` goes to
    member j) through one ``all_to_all_single`` of equal slots: room for the ``largest`` piece
    any member sends (the same on every member) and a flag slot (one element wide: every piece
    stays aligned for its dtype); and whether a member's contribution failed (CPU only: read
    where reading costs nothing)."""
    itemsize = like.element_size()
    recv_sizes = [math.prod(s) for s in recv_shapes]
    width = largest + 1
    k = len(sends)
    send = like.new_empty((k, width))
    for j, piece in enumerate(sends):
        if piece.numel():
            send.select(0, j).narrow(0, 0, piece.numel()).view(piece.shape).copy_(piece)  # one pass
    send_bytes = send.view(torch.uint8)
    send_bytes.select(1, width * itemsize - 1).fill_(int(failed))
    recv = like.new_empty((k, width))
    recv_bytes = recv.view(torch.uint8)
    dist.all_to_all_single(recv_bytes, send_bytes, group=group)
    pieces = [recv.select(0, j).narrow(0, 0, n).view(s) for j, (n, s) in enumerate(zip(recv_sizes, recv_shapes))]
    if like.device.type != "cpu":
        return pieces, None
    return pieces, bool(recv_bytes.select(1, width * itemsize - 1).any())


def _pieces_all_to_all(ins, group, index, shapes, value, failed: bool) -> tuple:
    """Member j holds shard j along ``dim``; each member receives chunk ``index`` along ``dim2``
    of every shard and joins them along ``dim`` (combine_one's all-to-all)."""
    k, dim, dim2 = len(shapes), ins.dim, ins.dim2
    m = value.shape[dim2]
    sends = [value.narrow(dim2, e.offset, e.length) for e in (chunk_extent(m, k, j) for j in range(k))]
    mine, most = chunk_extent(m, k, index).length, chunk_extent(m, k, 0).length  # torch.chunk: the first is largest
    recv_shapes = [s[:dim2] + (mine,) + s[dim2 + 1:] for s in map(tuple, shapes)]
    largest = max(math.prod(s[:dim2] + (most,) + s[dim2 + 1:]) for s in map(tuple, shapes))
    pieces, peers_failed = _all_to_all_flagged(group, sends, recv_shapes, largest, value, failed)
    return (None if peers_failed else torch.cat(pieces, dim=dim)), peers_failed


def _pieces_reduce_scatter(ins, group, index, shapes, value, failed: bool) -> tuple:
    """Each member receives every member's chunk ``index`` along ``dim`` and reduces them in
    group order (combine_one's reduce-scatter, the same bits)."""
    k, dim = len(shapes), ins.dim
    sends = [chunk_of(value, dim, k, j) for j in range(k)]
    pieces, peers_failed = _all_to_all_flagged(group, sends, [sends[index].shape] * k, sends[0].numel(), value, failed)
    return (None if peers_failed else reduce_all(pieces, ins.reduce_op)), peers_failed


_BY_PIECES = {"all_to_all": _pieces_all_to_all, "reduce_scatter": _pieces_reduce_scatter}


# ---------------------------------------------------------------------------------------------
# large payloads on CPU: the all-gather path receives every member's whole contribution and
# copies each payload twice (into its padded slot, out of it). From ``split_bytes`` the flags go
# first and the payload moves as the native path moves it (pure data movement: the same bits);
# an all-reduce is a reduce-scatter by pieces, in group order, then an all-gather of the reduced
# chunks (about 2 (k-1)/k of the tensor in and out per member, not k times it; the same bits),
# or between two members a floating-point sum the backend's own way (commutative: the same bits)
# ---------------------------------------------------------------------------------------------
def _peers_failed(group, k: int, failed: bool) -> bool:
    """Whether any member's contribution failed: one byte from each, before any payload moves
    (so a failure stops every member before the payload's collective, not after it)."""
    flags = torch.empty(k, dtype=torch.uint8)
    _all_gather_single(flags, torch.tensor([int(failed)], dtype=torch.uint8), group=group)
    return bool(flags.any())


def _moved_after_flags(ins, group, index, shapes, value, failed: bool, owned) -> tuple:
    if _peers_failed(group, len(shapes), failed):
        return None, True
    return _NATIVE[ins.kind](ins, group, index, shapes, value, owned), False


def _reduced_in_chunks(ins, group, index, shapes, value, failed: bool, owned) -> tuple:
    k = len(shapes)
    if _peers_failed(group, k, failed):
        return None, True
    if k == 2 and ins.reduce_op in ("sum", "avg") and value.dtype in (torch.float32, torch.float64):
        # two members: every algorithm adds each pair once, and a + b == b + a bit for bit
        return _native_all_reduce(ins, group, index, shapes, value, owned), False
    flat = value.reshape(-1)  # member j's piece is chunk j of it: consecutive slices, sent as they lie
    n = flat.numel()
    lengths = [chunk_extent(n, k, j).length for j in range(k)]
    width, mine = lengths[0], lengths[index]  # torch.chunk's: the first chunk is the largest
    recv = value.new_empty(k * width)
    dist.all_to_all_single(recv.narrow(0, 0, k * mine), flat, [mine] * k, lengths, group=group)
    reduced = reduce_all(list(recv.narrow(0, 0, k * mine).view(k, mine)), ins.reduce_op)  # group order
    if mine < width:
        reduced = torch.cat([reduced, reduced.new_zeros(width - mine)])
    # the whole into the source's own memory where it dies with the step, else into the receive
    # buffer (``reduced`` is a tensor of its own, so no member's input aliases its output)
    whole = flat if owned and value.is_contiguous() and width * k == n else recv
    _all_gather_single(whole.view(torch.uint8), reduced.view(torch.uint8), group=group)
    return whole.narrow(0, 0, n).view(value.shape), False


_LARGE = {"all_gather": _moved_after_flags, "all_to_all": _moved_after_flags, "all_reduce": _reduced_in_chunks}


def _shift(members, group, index, shapes, offset, value, failed: bool) -> tuple:
    """A shift by point-to-point sends: this member's bytes go to the member that receives from
    it, and it receives from member ``index + offset``; the same on every device type (nothing
    to reduce, so no order to keep). A flag byte travels behind the payload, read on CPU only
    (as in :func:`_all_gather_padded`)."""
    k = len(members)
    source, target = (index + offset) % k, (index - offset) % k
    if source == index:
        return value.clone(), False if value.device.type == "cpu" else None
    itemsize = value.element_size()
    send = torch.empty(itemsize * math.prod(shapes[index]) + 1, dtype=torch.uint8, device=value.device)
    if send.numel() > 1:
        send[:-1] = value.contiguous().reshape(-1).view(torch.uint8)
    send[-1] = int(failed)
    recv = torch.empty(itemsize * math.prod(shapes[source]) + 1, dtype=torch.uint8, device=value.device)
    ops = [dist.P2POp(dist.isend, send, members[target], group), dist.P2POp(dist.irecv, recv, members[source], group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    result = recv[:-1].view(value.dtype).reshape(shapes[source]) if recv.numel() > 1 else value.new_empty(shapes[source])
    return result, bool(recv[-1]) if value.device.type == "cpu" else None


# ---------------------------------------------------------------------------------------------
# native collectives: each returns this member's result as a tensor of its own (``owned``: it
# may be built in ``value``, which dies with the step)
# ---------------------------------------------------------------------------------------------
def _reduce(ins, tensor, group, collective, *args) -> None:
    op = ins.reduce_op
    if op == "avg" and tensor.dtype.is_floating_point and tensor.is_cuda:  # NCCL averages itself
        collective(*args, op=dist.ReduceOp.AVG, group=group)
        return
    collective(*args, op=_OPS["sum" if op == "avg" else op], group=group)
    if op == "avg":
        tensor.div_(dist.get_world_size(group))


def _native_all_reduce(ins, group, index, shapes, value, owned):
    # in place where the source dies with the step; otherwise into a copy (the source lives on)
    out = value if owned and value.is_contiguous() else value.clone(memory_format=torch.contiguous_format)
    _reduce(ins, out, group, dist.all_reduce, out)
    return out


def _native_all_gather(ins, group, index, shapes, value, owned):
    k, dim = len(shapes), ins.dim
    lengths = [s[dim] for s in shapes]
    rows = max(lengths)
    x = value.movedim(dim, 0)
    if lengths[index] == rows and x.is_contiguous():
        mine = x
    else:
        mine = x.new_zeros((rows,) + tuple(x.shape[1:]))
        mine[: lengths[index]] = x
    out = mine.new_empty((k * rows,) + tuple(mine.shape[1:]))
    _all_gather_single(out, mine, group=group)
    if any(n != rows for n in lengths):
        out = torch.cat([out[i * rows:i * rows + n] for i, n in enumerate(lengths)])
    return out.movedim(0, dim).contiguous() if dim else out


def _native_reduce_scatter(ins, group, index, shapes, value, owned):
    k, dim = len(shapes), ins.dim
    n = value.shape[dim]
    rows = chunk_extent(n, k, 0).length
    x = value.movedim(dim, 0)
    if rows * k == n and x.is_contiguous():
        full = x
    else:
        full = x.new_zeros((rows * k,) + tuple(x.shape[1:]))
        full[:n] = x
    out = full.new_empty((rows,) + tuple(full.shape[1:]))
    _reduce(ins, out, group, _reduce_scatter_single, out, full)
    out = out[: chunk_extent(n, k, index).length]
    return out.movedim(0, dim).contiguous() if dim else out.contiguous()


def _native_all_to_all(ins, group, index, shapes, value, owned):
    # member j holds shard j along ``dim`` (lengths from shapes) and all of ``dim2``; member i
    # gets chunk i along dim2 of every shard, joined along dim. Uneven: at most one copy into the
    # send buffer and one joining what arrived, none where the layouts allow
    k, dim, dim2 = len(shapes), ins.dim, ins.dim2
    m = value.shape[dim2]
    extents = [chunk_extent(m, k, i) for i in range(k)]
    if m % k == 0 and all(s == shapes[0] for s in shapes):
        # even: [k, piece] order (no copy where dim2 is the outermost dim longer than one), one
        # exchange, the pieces joined (a view where dim is)
        send = value.unflatten(dim2, (k, m // k)).movedim(dim2, 0).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.movedim(0, dim).flatten(dim, dim + 1)
    pieces = [value.narrow(dim2, e.offset, e.length) for e in extents]
    send_sizes = [p.numel() for p in pieces]
    if value.is_contiguous() and all(n == 1 for n in value.shape[:dim2]):
        send = value.reshape(-1)  # the pieces are consecutive slices of the source already
    else:
        send = value.new_empty(sum(send_sizes))
        for piece, start in zip(pieces, itertools.accumulate([0] + send_sizes)):
            send[start:start + piece.numel()].view(piece.shape).copy_(piece)  # one pass per piece
    recv_shapes = [s[:dim2] + (extents[index].length,) + s[dim2 + 1:] for s in map(tuple, shapes)]
    recv_sizes = [math.prod(s) for s in recv_shapes]
    recv = value.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    shape = list(recv_shapes[0])
    shape[dim] = sum(s[dim] for s in recv_shapes)
    if all(n == 1 for n in shape[:dim]):
        return recv.view(shape)  # joined along the outermost dim longer than one: received in place
    return torch.cat([p.view(s) for p, s in zip(recv.split(recv_sizes), recv_shapes)], dim=dim)


_NATIVE = {
    "all_reduce": _native_all_reduce,
    "all_gather": _native_all_gather,
    "reduce_scatter": _native_reduce_scatter,
    "all_to_all": _native_all_to_all,
}
