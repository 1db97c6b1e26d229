"""In-process communicator: the worker threads of one process meet in a shared table."""

from __future__ import annotations

import threading

import attrs

from .exchange import PENDING


@attrs.define
class _Slot:
    values: list
    owned: list  # per member: whether its contribution may become its result (``compute.owned``)
    arrived: int = 0
    left: int = 0
    results: list | None = None


def _compute(compute, slot: _Slot) -> list:
    """Every member's result; a compute with an ``owned`` attribute (the worker's CollectiveStep)
    also learns which members' contributions die with the step, to build results in them."""
    if True in slot.owned and hasattr(compute, "owned"):
        return compute(slot.values, slot.owned)
    return compute(slot.values)


def _take(slot: _Slot, index: int):
    """Member ``index``'s result, which the slot then stops holding: from here on the member's
    own (a later step that consumes it must find its store the sole holder, see
    worker/collectives.py's ``sole_holder``, while peers have yet to take theirs)."""
    result, slot.results[index] = slot.results[index], None
    slot.left += 1
    return result


@attrs.define
class InProcessExchange:
    """Every member of a group deposits a value under one key; the last to arrive computes every
    member's result with ``compute(values) -> list``, and each member leaves with its own (the
    slot drops its reference then, so that a later step may consume it in place).

    Members wait until the results exist, so no member can change its contribution (a tensor
    still in its store) while a peer reads it. Keys are (mesh id, mesh dim, group index,
    sequence number); every worker runs the same instruction stream, so members agree on keys
    without talking. ``timeout`` bounds a wait so a dead peer cannot hang the process.
    """

    timeout: float = 300.0
    turn: object = None  # a lock the waiting member gives up while it waits (see ThreadRunner)
    _slots: dict = attrs.field(factory=dict)
    _cond: threading.Condition = attrs.field(factory=threading.Condition)
    _aborted: str | None = None

    def exchange(self, key, index: int, size: int, value, compute):
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot([None] * size, [False] * size)
            slot.values[index] = value
            slot.owned[index] = getattr(compute, "owned", False)
            slot.arrived += 1
            last = slot.arrived == size
        if last:
            results = _compute(compute, slot)
            with self._cond:
                slot.results = results
                slot.values = None
                self._cond.notify_all()
        else:
            if self.turn is not None:
                self.turn.release()
            try:
                with self._cond:
                    ok = self._cond.wait_for(lambda: slot.results is not None or self._aborted, self.timeout)
            finally:
                if self.turn is not None:
                    self.turn.acquire()
            if self._aborted:
                raise RuntimeError(f"collective aborted: {self._aborted}")
            if not ok:
                raise TimeoutError(f"collective {key} timed out after {self.timeout}s waiting for peers")
        with self._cond:
            result = _take(slot, index)
            if slot.left == size:
                del self._slots[key]
        return result

    def abort(self, reason: str) -> None:
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()


@attrs.define
class LockstepExchange:
    """For runners that execute every rank in one thread, instruction by instruction.

    ``exchange`` records the contribution and returns PENDING; once every rank has run the
    instruction the runner calls ``Worker.finish_pending``, which ``collect``s all values.
    """

    _slots: dict = attrs.field(factory=dict)

    def exchange(self, key, index: int, size: int, value, compute):
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot([None] * size, [False] * size)
        slot.values[index] = value
        slot.owned[index] = getattr(compute, "owned", False)
        slot.arrived += 1
        return PENDING

    def collect(self, key, index: int, compute):
        slot = self._slots[key]
        if slot.results is None:
            slot.results = _compute(compute, slot)
            slot.values = None
        result = _take(slot, index)
        if slot.left == len(slot.results):
            del self._slots[key]
        return result
