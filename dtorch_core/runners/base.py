"""The runner base class: what the session asks of every runner, and reply collection."""

from __future__ import annotations

import threading

from ..errors import WorkerLostError
from ..worker.loop import Worker
from ..worker.streams import make_streams


class Runner:
    """Base: collects replies from workers; subclasses deliver batches.

    Interface used by the session: ``submit(batch)``, ``wait_replies(request_id, count,
    timeout)``, ``shutdown()``, and the attributes ``name`` and ``world_size``.
    """

    name = "?"
    collective_hints = False  # whether Collectives must carry every rank's shapes (planner/emit.py)

    def __init__(self, world_size: int, device_type: str, plugins):
        self.world_size = world_size
        self.device_type = device_type
        self.plugins = plugins  # the session's loaded plugins (dt.init resolves them once)
        self._replies: dict = {}
        self._cond = threading.Condition()
        self._dead: dict = {}

    def _reply(self, reply) -> None:
        with self._cond:
            self._replies.setdefault(reply.request_id, []).append(reply)
            self._cond.notify_all()

    def wait_replies(self, request_id: int, count: int, timeout: float) -> list:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len(self._replies.get(request_id, ())) >= count or self._dead, timeout
            )
            if self._dead:
                rank, reason = min(self._dead.items())
                raise WorkerLostError(
                    f"worker rank {rank} ({self.name} runner) is lost: {reason}; call dt.shutdown() and start again"
                )
            if not ok:
                raise WorkerLostError(
                    f"no reply from the workers within {timeout:.0f}s (timeout set by DTORCH_TIMEOUT or "
                    f"dt.init(timeout=...)); a worker may be stuck in a kernel or a collective"
                )
            return self._replies.pop(request_id)

    def _make_workers(self, exchange) -> list[Worker]:
        kernels = self.plugins.registry("kernels")
        workers = []
        for r in range(self.world_size):
            streams = make_streams(self.plugins.registry("streams"), self.device_type, r)
            workers.append(Worker(r, streams.device, kernels, exchange, self._reply, streams))
        return workers

    def shutdown(self) -> None:
        pass
