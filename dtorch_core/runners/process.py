"""The ``process`` runner: one OS process per device on this host.

Batches go to each worker through a local channel (shared memory when the native extension is
built, a pipe otherwise) in the pickle-free wire format; collectives run between the workers
through torch.distributed (gloo on CPU). The controller watches its workers: a worker that dies
makes the next call or read raise ``WorkerLostError`` naming its rank, and workers watch the
controller, so none outlives it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import structlog

from ..comm.kinds import choose_communicator
from ..errors import WorkerError, WorkerLostError
from ..ir import wire
from ..ir.instructions import DefinePlan, Put, Reply
from ..transport.channel import active_backend
from ..worker.streams import streams_class
from .base import Runner
from ..controller.session import FlushPolicy

log = structlog.get_logger(__name__)

READY = -1  # request id of the hello every worker sends once it is up
PROTOCOL = 0  # request id of a worker's report that it rejected a frame
SHUTDOWN = b""  # an empty frame asks a worker to exit


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def for_rank(batch: list, rank: int) -> list:
    """The batch as ``rank`` needs it: only its own shards and per-rank arguments."""
    out = []
    for ins in batch:
        t = type(ins)
        if t is Put:
            shard = ins.shards.get(rank)
            ins = Put(ins.tid, ins.mesh_id, {} if shard is None else {rank: shard})
        elif t is DefinePlan and ins.rank_args:
            mine = ins.rank_args.get(rank)
            ins = DefinePlan(ins.plan_id, ins.mesh_id, ins.target, ins.args, ins.kwargs,
                             {rank: mine} if mine is not None else None, ins.op_name, ins.seeded)
        out.append(ins)
    return out


class ProcessRunner(Runner):
    """Spawns ``world_size`` worker processes and talks to them over local channels."""

    name = "process"
    collective_hints = True  # DistExchange moves payloads without headers
    flush_policy = FlushPolicy(batch_size=256, interval=0.002, when_idle=False, first_batch=4)

    def __init__(self, world_size: int, device_type: str = "cpu", timeout: float = 300.0,
                 startup_timeout: float | None = None, communicator: str | None = None,
                 dist_backend: str | None = None, *, plugins, **_options):
        create_channel = plugins.registry("transports").get("local")
        # gloo for CPU workers; a device plugin (dtorch_nccl for cuda) registers the one for its type
        communicator, chosen = choose_communicator(plugins.registry("communicators"), "process", device_type,
                                                   communicator)
        dist_backend = dist_backend or chosen.dist_backend
        streams_class(plugins.registry("streams"), device_type).device_for(device_type, 0)  # a missing device raises here, not in a worker

        super().__init__(world_size, device_type, plugins)
        self.timeout = timeout
        self.backend = active_backend()
        self._closing = False
        self._protocol_errors: list = []
        port = free_port()
        self.to_workers = []
        self.from_workers = []
        self.procs = []
        threads = int(os.environ.get("DTORCH_WORKER_THREADS", max(1, (os.cpu_count() or 1) // world_size)))
        env = dict(os.environ)
        # workers import what the controller can import (its sys.path, this package included)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [pkg_root] + [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["OMP_NUM_THREADS"] = str(threads)
        oversubscribed = (os.cpu_count() or 1) <= world_size
        if oversubscribed and "DTORCH_CHANNEL_SPIN_US" not in os.environ:
            # more busy processes than cores: a waiting channel end that spins takes the core
            # the controller or a peer needs, so every end sleeps at once
            env["DTORCH_CHANNEL_SPIN_US"] = "0"
        # the controller is the critical path: when cores are short, workers yield to it
        nice = int(os.environ.get("DTORCH_WORKER_NICE", 19 if oversubscribed else 0))
        spin = {"spin_us": 0.0} if env.get("DTORCH_CHANNEL_SPIN_US") == "0" else {}
        for rank in range(world_size):
            down, down_spec = create_channel("send", **spin)
            up, up_spec = create_channel("recv", **spin)
            config = {
                "rank": rank,
                "world_size": world_size,
                "master_port": port,
                "device_type": device_type,
                "parent_pid": os.getpid(),
                "timeout": timeout,
                "threads": threads,
                "communicator": communicator,
                "nice": nice,
                "backend": dist_backend,
                "recv": down_spec.encode(),
                "send": up_spec.encode(),
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "dtorch_core.worker_main", json.dumps(config)],
                env=env,
                pass_fds=down_spec.pass_fds + up_spec.pass_fds,
                stdin=subprocess.DEVNULL,
            )
            down.child_started(proc.pid)
            up.child_started(proc.pid)
            self.to_workers.append(down)
            self.from_workers.append(up)
            self.procs.append(proc)
        _live_runners.add(self)
        self._readers = [
            threading.Thread(target=self._read_loop, args=(r,), name=f"dtorch-replies-{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in self._readers:
            t.start()
        self._monitor = threading.Thread(target=self._watch, name="dtorch-monitor", daemon=True)
        self._monitor.start()
        try:
            self.wait_replies(READY, world_size, startup_timeout or max(60.0, 15.0 * world_size))
        except Exception:
            self.shutdown()
            raise
        log.debug("process runner up", world_size=world_size, channel=self.backend)

    # -- sending --------------------------------------------------------------------------
    def submit(self, batch) -> None:
        self._raise_if_dead()
        shared = None
        if not any(type(ins) is Put or (type(ins) is DefinePlan and ins.rank_args) for ins in batch):
            shared = wire.encode(batch)  # the common case: every rank gets the same bytes
        for rank, channel in enumerate(self.to_workers):
            data = shared if shared is not None else wire.encode(for_rank(batch, rank))
            try:
                channel.send(data)
            except Exception as exc:
                self._mark_dead(rank, f"its channel broke: {exc!r}")
                self._raise_if_dead()

    # -- receiving ------------------------------------------------------------------------
    def _read_loop(self, rank: int) -> None:
        channel = self.from_workers[rank]
        while True:
            try:
                data = channel.recv(None)
            except Exception as exc:
                if not self._closing:
                    self._mark_dead(rank, self._exit_reason(rank, wait=1.0) or f"its channel closed ({exc})")
                return
            try:
                reply = wire.decode(data)
            except Exception as exc:
                self._mark_dead(rank, f"it sent an undecodable reply ({exc})")
                return
            if not isinstance(reply, Reply):
                self._mark_dead(rank, f"it sent {type(reply).__name__} instead of a reply")
                return
            if reply.request_id == PROTOCOL:
                with self._cond:
                    self._protocol_errors.append(reply.error)
                    self._cond.notify_all()
                continue
            self._reply(reply)

    def _exit_reason(self, rank: int, wait: float = 0.0) -> str | None:
        proc = self.procs[rank]
        try:
            code = proc.wait(wait) if wait else proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if code is None:
            return None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"its process (pid {proc.pid}) {how}"

    def _watch(self) -> None:
        while not self._closing:
            for rank in range(len(self.procs)):
                reason = self._exit_reason(rank)
                if reason is not None and not self._closing:
                    self._mark_dead(rank, reason)
            time.sleep(0.1)

    def _mark_dead(self, rank: int, reason: str) -> None:
        with self._cond:
            self._dead.setdefault(rank, reason)
            self._cond.notify_all()

    def _raise_if_dead(self) -> None:
        if self._dead:
            rank, reason = next(iter(sorted(self._dead.items())))
            raise WorkerLostError(f"worker rank {rank} (process runner) is lost: {reason}; call dt.shutdown() and start again")

    def wait_replies(self, request_id: int, count: int, timeout: float) -> list:
        # a worker answers in order, so a rejected frame sent before this request is reported
        # before the reply we wait for
        replies = super().wait_replies(request_id, count, timeout)
        with self._cond:
            if self._protocol_errors:
                f = self._protocol_errors.pop(0)
                raise WorkerError(f"worker rank {f.rank} rejected a batch: {f.message}",
                                  rank=f.rank, op=f.op, source=None)
        return replies

    # -- shutdown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for channel in self.to_workers:
            try:
                channel.send(SHUTDOWN)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for channel in self.to_workers + self.from_workers:
            try:
                channel.close()
            except Exception:
                pass
        # drop the channels: native ones still referenced when the interpreter ends are reported
        # as leaks by nanobind
        self.to_workers, self.from_workers = [], []
        _live_runners.discard(self)


_live_runners: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_workers_at_exit() -> None:
    for runner in list(_live_runners):
        try:
            runner.shutdown()
        except Exception:
            pass
