"""In-process communicator: the worker threads of one process meet in a shared table."""

from __future__ import annotations

import threading

import attrs


@attrs.define
class _Slot:
    values: list
    arrived: int = 0
    left: int = 0


@attrs.define
class InProcessExchange:
    """Every member of a group deposits a value under one key and receives all of them.

    Keys are (mesh id, mesh dim, group index, sequence number); since every worker runs the same
    instruction stream, members agree on keys without talking. ``timeout`` bounds a wait so a
    dead peer cannot hang the process.
    """

    timeout: float = 300.0
    _slots: dict = attrs.field(factory=dict)
    _cond: threading.Condition = attrs.field(factory=threading.Condition)
    _aborted: str | None = None

    def exchange(self, key, index: int, size: int, value):
        with self._cond:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot([None] * size)
            slot.values[index] = value
            slot.arrived += 1
            if slot.arrived == size:
                self._cond.notify_all()
            else:
                ok = self._cond.wait_for(lambda: slot.arrived == size or self._aborted, self.timeout)
                if self._aborted:
                    raise RuntimeError(f"collective aborted: {self._aborted}")
                if not ok:
                    raise TimeoutError(f"collective {key} timed out after {self.timeout}s waiting for peers")
            values = list(slot.values)
            slot.left += 1
            if slot.left == size:
                del self._slots[key]
            return values

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

    def exchange(self, key, index: int, size: int, value):
        from ..runtime.worker import PENDING

        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot([None] * size)
        slot.values[index] = value
        slot.arrived += 1
        return PENDING

    def collect(self, key, index: int):
        slot = self._slots[key]
        slot.left += 1
        if slot.left == len(slot.values):
            del self._slots[key]
        return list(slot.values)
