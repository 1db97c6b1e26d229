"""One copy per node: how a batch is cut for the node leaders, and how a worker puts it back.

The controller sends each node (the workers that reported the same node in their ``HELLO``:
``DTORCH_NODE_ID``, else the host name) one copy of a batch; the node's leader (its lowest rank)
hands it to the others through shared memory (``node.py``). Most batches are the same for every
rank and travel as they are (a ``BATCH`` frame). A batch with per-rank payloads (a ``Put`` of
shards, a ``DefinePlan`` with ``rank_args``, a ``DefineProgram`` with constants) is cut in two
(:func:`split_batch`): the *common* batch, with those payloads taken out, encoded once for the
whole world, and one small *part* per rank ``{instruction index: payload}``. A node gets the
common batch once and the parts of its own ranks (a ``NODE_BATCH`` frame, :func:`node_parts`),
and each worker merges its part back (:func:`merge_part`), which gives exactly the batch
``runners.process.for_rank`` would have made for it.

Messages on a node's shared-memory channels (no pickle; the wire format's magic tells them
apart): a plain wire batch (``DW...``), a ranked batch ``DR`` + u64 length of the common batch +
common + part, :data:`SHUTDOWN` (``b""``), and the one-byte :data:`PING` and ``C`` + u64
(:data:`CREDIT`, batches taken so far, follower to leader).
"""

from __future__ import annotations

import struct

import attrs

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import DefinePlan, DefineProgram, Put

from . import frames as fr

RANKED = b"DR"
PING = b"P"
CREDIT = b"C"
SHUTDOWN = b""
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PAIR = struct.Struct("<II")


def has_rank_parts(batch) -> bool:
    """Whether some instruction of ``batch`` carries payloads that differ per rank."""
    for ins in batch:
        t = type(ins)
        if t is Put or (t is DefinePlan and ins.rank_args) or (t is DefineProgram and ins.constants):
            return True
    return False


def split_batch(batch) -> tuple[list, dict[int, dict[int, object]]]:
    """(the common batch, ``{rank: {instruction index: payload}}``) of a batch with rank parts."""
    common: list = []
    parts: dict[int, dict[int, object]] = {}
    for i, ins in enumerate(batch):
        t = type(ins)
        if t is Put:
            common.append(Put(ins.tid, ins.mesh_id, {}))
            for rank, shard in ins.shards.items():
                parts.setdefault(rank, {})[i] = shard
        elif t is DefinePlan and ins.rank_args:
            common.append(attrs.evolve(ins, rank_args=None))
            for rank, mine in ins.rank_args.items():
                if mine is not None:
                    parts.setdefault(rank, {})[i] = mine
        elif t is DefineProgram and ins.constants:
            common.append(attrs.evolve(ins, constants=tuple(Put(p.tid, p.mesh_id, {}) for p in ins.constants)))
            for rank in set().union(*(p.shards for p in ins.constants)):
                parts.setdefault(rank, {})[i] = tuple(p.shards.get(rank) for p in ins.constants)
        else:
            common.append(ins)
    return common, parts


def merge_part(batch: list, part, rank: int) -> list:
    """Put ``rank``'s payloads (a decoded part) back into the decoded common ``batch``."""
    if type(part) is not dict:
        raise wire.WireError(f"a rank part is a dict of instruction index -> payload, not {type(part).__name__}")
    for i, payload in part.items():
        if type(i) is not int or not 0 <= i < len(batch):
            raise wire.WireError(f"a rank part names instruction {i!r} of a batch of {len(batch)}")
        ins = batch[i]
        t = type(ins)
        if t is Put:
            batch[i] = Put(ins.tid, ins.mesh_id, {rank: payload})
        elif t is DefinePlan:
            batch[i] = attrs.evolve(ins, rank_args={rank: payload})
        elif t is DefineProgram and type(payload) is tuple and len(payload) == len(ins.constants):
            batch[i] = attrs.evolve(ins, constants=tuple(
                Put(p.tid, p.mesh_id, {} if s is None else {rank: s}) for p, s in zip(ins.constants, payload)))
        else:
            raise wire.WireError(f"a rank part for instruction {i} ({t.__name__}) that takes none")
    return batch


# -- a NODE_BATCH frame: [index, *common parts, *parts of rank a, *parts of rank b, ...] -----------
def node_parts(common: list, ranked: list[tuple[int, list]]) -> list:
    """The payload of a ``NODE_BATCH``: an index, the common frames, then each rank's frames."""
    index = bytearray(_U32.pack(len(common)))
    index += _U32.pack(len(ranked))
    for rank, frames in ranked:
        index += _PAIR.pack(rank, len(frames))
    out = [bytes(index), *common]
    for _, frames in ranked:
        out.extend(frames)
    return out


def parse_node_parts(parts) -> tuple[list, dict[int, list]]:
    """(common frames, ``{rank: its frames}``) of a ``NODE_BATCH`` payload; WireError if malformed."""
    index = memoryview(parts[0]) if parts else memoryview(b"")
    if index.nbytes < 8:
        raise wire.WireError("node batch: no index")
    (n_common,) = _U32.unpack_from(index, 0)
    (n_ranks,) = _U32.unpack_from(index, 4)
    if index.nbytes != 8 + n_ranks * _PAIR.size:
        raise wire.WireError("node batch: index of the wrong size")
    at = 1 + n_common
    common = list(parts[1:at])
    by_rank: dict[int, list] = {}
    for k in range(n_ranks):
        rank, count = _PAIR.unpack_from(index, 8 + k * _PAIR.size)
        by_rank[rank] = list(parts[at:at + count])
        at += count
    if at != len(parts) or len(common) != n_common:
        raise wire.WireError("node batch: the index does not match its frames")
    return common, by_rank


def ranked_message(common, part) -> bytes:
    """The shared-memory message of a batch with a rank part (``DR`` + length + common + part)."""
    common = memoryview(common)
    return b"".join((RANKED, _U64.pack(common.nbytes), common, memoryview(part)))


def decode_local(data, rank: int) -> list:
    """The batch of a message a worker got: wire bytes, ``(common, part)``, or a ranked message."""
    part = None
    if type(data) is tuple:
        common, part = data
    else:
        view = memoryview(data)
        if view[:2] == RANKED:
            if view.nbytes < 10:
                raise wire.WireError("ranked batch shorter than its header")
            (n,) = _U64.unpack_from(view, 2)
            if n > view.nbytes - 10:
                raise wire.WireError("ranked batch: the common part runs past the message")
            common, part = view[10:10 + n], view[10 + n:]
        else:
            common = view
    batch = wire.decode(common)
    if not isinstance(batch, list):
        raise wire.WireError(f"expected a list of instructions, got {type(batch).__name__}")
    if part is not None:
        merge_part(batch, wire.decode(part), rank)
    return batch


def encoded_frames(value) -> list:
    """``value`` in the wire format as ZMQ frames (large tensor bytes as frames of their own)."""
    return fr.payload_parts(wire.encode_parts(value))
