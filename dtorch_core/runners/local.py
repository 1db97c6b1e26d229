"""Builtin runners: ``inline`` (synchronous, in the caller's thread) and ``thread``."""

from __future__ import annotations

import functools
import queue
import threading

import structlog

from ..comm.inprocess import LockstepExchange
from ..comm.kinds import choose_communicator
from ..errors import DeviceError, WorkerLostError
from ..ir.instructions import RunProgram
from ..controller.session import FlushPolicy
from ..worker.streams import make_streams
from ..worker.loop import Worker

log = structlog.get_logger(__name__)


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


class ThreadRunner(Runner):
    """One worker thread per device; batches go through in-process queues.

    The workers share the controller's GIL, and torch drops and retakes the GIL in every op, so
    threads running Python at once hand the GIL back and forth at every op (each hand-over is a
    futex wake-up, several times the cost of a small op). Hence:
    - batches leave when the controller pauses (a timer tick with nothing new), at sync points,
      or when 16384 instructions wait;
    - workers take turns (``turn``): one runs its batch at a time, and gives the turn up only
      when it waits for peers in a collective or finishes its batch. Kernels still use torch's
      intra-op threads, so a large kernel keeps every core busy.
    """

    name = "thread"
    flush_policy = FlushPolicy(batch_size=16384, interval=0.001, when_idle=True)

    def __init__(self, world_size: int, device_type: str = "cpu", timeout: float = 300.0,
                 communicator: str | None = None, *, plugins, **_options):
        super().__init__(world_size, device_type, plugins)
        self.turn = threading.Lock()
        _, comm = choose_communicator(plugins.registry("communicators"), "thread", device_type, communicator)
        self.exchange = comm.create(timeout=timeout, turn=self.turn)
        self.workers = self._make_workers(self.exchange)
        self.queues = [queue.SimpleQueue() for _ in range(world_size)]
        self.threads = [
            threading.Thread(target=self._loop, args=(r,), name=f"dtorch-worker-{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in self.threads:
            t.start()

    def submit(self, batch) -> None:
        for q in self.queues:
            q.put(batch)

    def _loop(self, rank: int) -> None:
        worker = self.workers[rank]
        q = self.queues[rank]
        while True:
            batch = q.get()
            if batch is None:
                return
            try:
                with self.turn:
                    worker.streams.run(functools.partial(worker.run_batch, batch))
            except BaseException as exc:  # a bug in the worker itself, not in a kernel
                worker.log.error("worker crashed", error=repr(exc), exc_info=True)
                with self._cond:
                    self._dead[rank] = repr(exc)
                    self._cond.notify_all()
                self.exchange.abort(f"worker {rank} crashed")
                return

    def shutdown(self) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout=10)
