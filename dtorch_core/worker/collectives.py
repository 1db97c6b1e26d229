"""The worker's collective instructions: redistribution steps among the ranks of a mesh group.

A communicating step (COMMUNICATING_KINDS) hands this rank's contribution to the communicator
(``exchange.exchange(key, index, size, value, compute)``) with a :class:`CollectiveStep` that
computes every member's result; a lockstep communicator answers PENDING and the results are
collected in :meth:`WorkerCollectives.finish_pending` once every rank has contributed. Steps
that need no peers (``alias``, ``local_chunk``, ``to_partial``, groups of one) run locally.

A step the controller marks ``consume`` (its source dies with it) builds its result in the
source's buffer instead of a copy, where this worker finds nothing else holding that memory
(:func:`sole_holder`): an all-reduce reduces into it, a group of one keeps it.
"""

from __future__ import annotations

import functools
import math
import sys

import attrs
import torch

from ..comm.collectives import combine_all, combine_one, local_step
from ..comm.exchange import PENDING
from ..ir.instructions import COMMUNICATING_KINDS, Collective, MergedAllReduce, WorkerFailure


@attrs.frozen
class CollectiveStep:
    """Every member's results of ``ins`` from all contributions (a failed one fails them all).

    The instruction travels with it: communicators between processes run it natively instead
    (comm/dist.py)."""

    ins: Collective
    rank: int
    owned: bool = False  # this member's contribution dies with the step: its result may be built in it

    def __call__(self, values: list, owned=()) -> list:
        """``owned``: per member, ``owned`` of its step (in-process communicators collect them)."""
        for v in values:
            if type(v) is WorkerFailure:
                return [v] * len(values)
        ins = self.ins
        try:
            return combine_all(ins.kind, values, ins.dim, ins.reduce_op, ins.dim2, ins.offset, owned)
        except Exception as exc:
            failure = WorkerFailure(self.rank, f"collective {ins.kind}", None, f"{type(exc).__name__}: {exc}")
            return [failure] * len(values)

    def one(self, values: list, index: int, out=None):
        """Member ``index``'s result alone (communicators where each member computes its own);
        ``out``: its consumed contribution, aliasing none of ``values``."""
        ins = self.ins
        try:
            return combine_one(ins.kind, values, ins.dim, ins.reduce_op, ins.dim2, index, ins.offset, out)
        except Exception as exc:
            return WorkerFailure(self.rank, f"collective {ins.kind}", None, f"{type(exc).__name__}: {exc}")


# the references to a stored tensor while sole_holder looks at it: the store's entry, the
# caller's variable, sole_holder's argument and getrefcount's own
_STORED_REFS = 4
_storage_use_count = torch._C._storage_Use_Count


def sole_holder(x) -> bool:
    """Whether the store's entry is all that holds ``x``'s memory on this worker: no other id (an
    alias), view, program constant or in-process caller's tensor shares it. Its storage object
    counts once more while asked."""
    return (sys.getrefcount(x) <= _STORED_REFS and x._use_count() == 1
            and _storage_use_count(x.untyped_storage()._cdata) == 2)


class WorkerCollectives:
    """The collective instructions of :class:`~dtorch_core.worker.loop.Worker` (a mixin).

    Uses the worker's ``rank``, ``meshes``, ``store``, ``streams``, ``exchange``, ``seq`` (per
    group, the next collective's sequence number), ``pending`` and ``_lookup``.
    """

    def _collective(self, ins: Collective) -> None:
        view = self.meshes.get(ins.mesh_id)
        if view is None:
            return
        x = self._lookup(ins.src)
        owned = ins.consume and type(x) is not WorkerFailure and sole_holder(x)
        gi, index, size = view.groups[ins.mesh_dim]
        if size == 1 and ins.kind in COMMUNICATING_KINDS:
            # a group of one: every communicating kind returns the contribution (a tensor of its own)
            if self.streams.outstanding and type(x) is not WorkerFailure:
                self.streams.join_reads((x,))
            self.store[ins.dst] = x if type(x) is WorkerFailure or owned else x.clone()
            return
        if ins.kind not in COMMUNICATING_KINDS:
            if type(x) is WorkerFailure:
                self.store[ins.dst] = x
                return
            if self.streams.outstanding:
                self.streams.join_reads((x,))
            self.store[ins.dst] = local_step(ins.kind, x, index, size, ins.dim, ins.reduce_op)
            return
        self._communicate(ins, gi, index, size, x, functools.partial(self.store.__setitem__, ins.dst), owned)

    def _communicate(self, ins, gi: int, index: int, size: int, x, done, owned: bool = False) -> None:
        """Run ``ins`` (a communicating step) with contribution ``x``; ``done(result)`` stores it
        now, or once the peers have contributed (lockstep runners). ``owned``: the result may be
        built in ``x``."""
        group_key = (ins.mesh_id, ins.mesh_dim, gi)
        seq = self.seq.get(group_key, 0)
        self.seq[group_key] = seq + 1
        key = group_key + (seq,)
        compute = CollectiveStep(ins, self.rank, owned)
        result = self.streams.communicate(functools.partial(self.exchange.exchange, key, index, size, x, compute), x)
        if result is PENDING:
            self.pending.append((key, index, compute, done))
        else:
            done(result)

    def _merged_all_reduce(self, ins: MergedAllReduce) -> None:
        view = self.meshes.get(ins.mesh_id)
        if view is None:
            return
        gi, index, size = view.groups[ins.mesh_dim]
        values = [self._lookup(tid) for tid in ins.srcs]
        # one exchange per dtype, in first-appearance order: the same on every rank, also on one
        # whose sources failed (the instruction names the dtypes)
        dtypes = ins.dtypes or [getattr(v, "dtype", None) for v in values]
        by_dtype: dict = {}
        for i, dtype in enumerate(dtypes):
            by_dtype.setdefault(dtype, []).append(i)
        for dtype, members in by_dtype.items():
            failure = next((values[i] for i in members if type(values[i]) is WorkerFailure), None)
            if self.streams.outstanding and failure is None:
                self.streams.join_reads(tuple(values[i] for i in members))
            packed = failure or torch.cat([values[i].reshape(-1) for i in members])
            shapes = tuple((sum(math.prod(per_rank[i]) for i in members),) for per_rank in ins.shapes)
            step = Collective("all_reduce", ins.mesh_id, ins.mesh_dim, -1, -1, 0, ins.reduce_op, 0, shapes, dtype)
            unpack = functools.partial(self._unpack, [ins.dsts[i] for i in members], [values[i] for i in members])
            if size == 1:  # a group of one: the (new) packed tensor is the result
                unpack(packed)
                continue
            self._communicate(step, gi, index, size, packed, unpack)

    def _unpack(self, dsts, values, result) -> None:
        if type(result) is WorkerFailure:
            for tid in dsts:
                self.store[tid] = result
            return
        if self.streams.outstanding:
            self.streams.join_reads((result,))  # the pieces are views: order compute after the whole
        offset = 0
        for tid, v in zip(dsts, values):
            n = v.numel()
            self.store[tid] = result[offset:offset + n].view(v.shape)
            offset += n

    def finish_pending(self) -> None:
        """Complete collectives whose peers have all contributed (lockstep runners)."""
        pending, self.pending = self.pending, []
        for key, index, compute, done in pending:
            done(self.exchange.collect(key, index, compute))
