"""The ``thread`` runner: one worker thread per device in the controller's process."""

from __future__ import annotations

import functools
import queue
import threading

from ..comm.kinds import choose_communicator
from ..controller.session import FlushPolicy
from .base import Runner


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
