"""The ``inline`` runner: every batch runs at once in the controller's thread (the reference)."""

from __future__ import annotations

from ..comm.inprocess import LockstepExchange
from ..errors import DeviceError
from ..ir.instructions import RunProgram
from .base import Runner


class InlineRunner(Runner):
    """Executes every batch at once in the controller's thread, rank by rank (the reference)."""

    name = "inline"

    def __init__(self, world_size: int, device_type: str = "cpu", *, plugins, **_options):
        if device_type != "cpu":
            # every rank runs in this one thread, one instruction at a time: there is no place
            # for per-device streams, and it is the CPU reference anyway
            raise DeviceError(
                f"the inline runner runs CPU workers only; use runner='thread' or 'process' for "
                f"device_type={device_type!r}"
            )
        super().__init__(world_size, device_type, plugins)
        self.workers = self._make_workers(LockstepExchange())

    def submit(self, batch) -> None:
        for ins in batch:
            if type(ins) is RunProgram:
                # a replay runs step by step on every rank too, so its collectives meet
                for steps in zip(*[w.expand_program(ins) for w in self.workers]):
                    self._step(steps)
            else:
                self._step([ins] * len(self.workers))

    def _step(self, per_worker) -> None:
        for w, ins in zip(self.workers, per_worker):
            w.execute(ins)
        for w in self.workers:
            if w.pending:
                w.finish_pending()
