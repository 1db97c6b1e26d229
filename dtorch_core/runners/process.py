"""The ``process`` runner: one OS process per device on this host.

Batches go to each worker through a local channel (shared memory when the native extension is
built, a pipe otherwise) in the pickle-free wire format; collectives run between the workers
through torch.distributed (gloo on CPU). The controller watches its workers: a worker that dies
makes the next call or read raise ``WorkerLostError`` naming its rank, and workers watch the
controller, so none outlives it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
import weakref

import attrs
import structlog

from ..comm.kinds import choose_communicator
from ..errors import WorkerError, WorkerLostError
from ..ir import wire
from ..ir.instructions import DefinePlan, DefineProgram, Put, Reply
from ..transport.channel import active_backend
from ..worker.streams import streams_class
from .base import Runner
from .sending import Sender, SendStalled
from .spawn import config_pipe, private_dir, remove_dir, store_url, worker_command, worker_env
from ..controller.session import FlushPolicy
from ..controller.settings import setting

log = structlog.get_logger(__name__)

READY = -1  # request id of the hello every worker sends once it is up
PROTOCOL = 0  # request id of a worker's report that it rejected a frame
SHUTDOWN = b""  # an empty frame asks a worker to exit


def for_rank(batch: list, rank: int) -> list:
    """The batch as ``rank`` needs it: only its own shards and per-rank arguments."""
    out = []
    for ins in batch:
        t = type(ins)
        if t is Put:
            ins = _put_for_rank(ins, rank)
        elif t is DefineProgram and ins.constants:
            ins = attrs.evolve(ins, constants=tuple(_put_for_rank(put, rank) for put in ins.constants))
        elif t is DefinePlan and ins.rank_args:
            mine = ins.rank_args.get(rank)
            ins = DefinePlan(ins.plan_id, ins.mesh_id, ins.target, ins.args, ins.kwargs,
                             {rank: mine} if mine is not None else None, ins.op_name, ins.seeded)
        out.append(ins)
    return out


def _put_for_rank(put: Put, rank: int) -> Put:
    shard = put.shards.get(rank)
    return Put(put.tid, put.mesh_id, {} if shard is None else {rank: shard})


# the classes that may carry per-rank parts (checked in C first: most batches hold none)
_PER_RANK_TYPES = frozenset({Put, DefinePlan, DefineProgram})


class ProcessRunner(Runner):
    """Spawns ``world_size`` worker processes and talks to them over local channels."""

    name = "process"
    collective_hints = True  # DistExchange moves payloads without headers
    # 32-instruction batches: a worker that waits for a batch of 256 leaves its GPU idle while the
    # controller issues them (one H200, bench/model_steps.py large: gpt2 30.7 -> 29.7 ms, DiT
    # 28.4 -> 26.6 ms a step for 256 -> 32, same GPU time; torch 28.6 / 25.3 ms)
    flush_policy = FlushPolicy(batch_size=32, interval=0.002, when_idle=False, first_batch=4)

    def __init__(self, world_size: int, device_type: str = "cpu", timeout: float = 300.0,
                 startup_timeout: float | None = None, communicator: str | None = None,
                 dist_backend: str | None = None, *, plugins, **_options):
        create_channel = plugins.registry("transports").get("local")
        # gloo for CPU workers; a device plugin (dtorch_nccl for cuda) registers the one for its type
        communicator, chosen = choose_communicator(plugins.registry("communicators"), "process", device_type,
                                                   communicator)
        dist_backend = dist_backend or chosen.dist_backend
        streams_cls = streams_class(plugins.registry("streams"), device_type)
        streams_cls.device_for(device_type, 0)  # a missing device raises here, not in a worker
        # flush on drain: a worker whose device runs its work asynchronously (CUDA) raises a flag
        # in its channel when it has taken every batch and the device has finished them; the
        # session then sends what it holds at once instead of filling a batch while the device
        # idles (a step's first ops, after a sync). DTORCH_FLUSH_ON_DRAIN=0 turns it off.
        self._report_drain = streams_cls.reports_drain and os.environ.get("DTORCH_FLUSH_ON_DRAIN", "1") != "0"

        super().__init__(world_size, device_type, plugins)
        self.timeout = timeout
        self.backend = active_backend()
        self._closing = False
        self._protocol_errors: list = []
        self.to_workers = []
        self.from_workers = []
        self.procs = []
        self.senders: list[Sender] = []
        threads = setting("worker_threads", None, "DTORCH_WORKER_THREADS",
                          max(1, (os.cpu_count() or 1) // world_size), "int", minimum=1)
        env = worker_env(threads)
        oversubscribed = (os.cpu_count() or 1) <= world_size
        if oversubscribed and "DTORCH_CHANNEL_SPIN_US" not in os.environ:
            # more busy processes than cores: a waiting channel end that spins takes the core
            # the controller or a peer needs, so every end sleeps at once
            env["DTORCH_CHANNEL_SPIN_US"] = "0"
        # the controller is the critical path: when cores are short, workers yield to it
        nice = setting("worker_nice", None, "DTORCH_WORKER_NICE", 19 if oversubscribed else 0, "int", minimum=0)
        spin = {"spin_us": 0.0} if env.get("DTORCH_CHANNEL_SPIN_US") == "0" else {}
        # a worker dies with the thread that started it (PR_SET_PDEATHSIG): only safe to ask
        # when that thread is the main one, which lives as long as the controller
        on_main = threading.current_thread() is threading.main_thread()
        self._rdv = private_dir()  # the FileStore rendezvous; removed at shutdown
        _live_runners.add(self)
        try:
            for rank in range(world_size):
                down, down_spec = create_channel("send", **spin)
                up, up_spec = create_channel("recv", **spin)
                config = {
                    "rank": rank,
                    "world_size": world_size,
                    "init_method": store_url(self._rdv),
                    "device_type": device_type,
                    "parent_pid": os.getpid(),
                    "die_with_parent": on_main,
                    "timeout": timeout,
                    "threads": threads,
                    "communicator": communicator,
                    "nice": nice,
                    "backend": dist_backend,
                    "report_drain": self._report_drain,
                    "recv": down_spec.encode(),
                    "send": up_spec.encode(),
                }
                self.to_workers.append(down)
                self.from_workers.append(up)
                config_fd = config_pipe(config)
                try:
                    proc = subprocess.Popen(
                        worker_command(config_fd),
                        env=env,
                        pass_fds=(config_fd,) + down_spec.pass_fds + up_spec.pass_fds,
                        stdin=subprocess.DEVNULL,
                    )
                finally:
                    os.close(config_fd)
                down.child_started(proc.pid)
                up.child_started(proc.pid)
                self.procs.append(proc)
                self.senders.append(Sender(rank, down, self._send_failed))
        except BaseException:
            self.shutdown()
            raise
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
        except BaseException:
            self.shutdown()
            raise
        log.debug("process runner up", world_size=world_size, channel=self.backend)

    # -- sending --------------------------------------------------------------------------
    def hunger_words(self) -> tuple:
        """The addresses of the workers' drained flags (see ``__init__``), for the session's
        native hot path; empty when the workers do not report (CPU, pipes, turned off)."""
        if not self._report_drain or not all(hasattr(ch, "hungry_word") for ch in self.to_workers):
            return ()
        return tuple(ch.hungry_word() for ch in self.to_workers)

    def any_hungry(self) -> bool:
        """Whether a worker has taken every batch and its device has run dry."""
        return any(ch.peer_hungry() for ch in self.to_workers)

    def submit(self, batch) -> None:
        self._raise_if_dead()
        shared = None
        if _PER_RANK_TYPES.isdisjoint(map(type, batch)) or not any(
                type(ins) is Put or (type(ins) is DefinePlan and ins.rank_args)
                or (type(ins) is DefineProgram and ins.constants) for ins in batch):
            shared = wire.encode(batch)  # the common case: every rank gets the same bytes
        for rank, sender in enumerate(self.senders):
            data = shared if shared is not None else wire.encode(for_rank(batch, rank))
            try:
                sender.send(data, self.timeout)  # never blocks on the channel itself
            except SendStalled as exc:
                self._mark_dead(rank, f"it took no batch for {self.timeout:g}s ({exc}); it is stopped or hung "
                                      "(the timeout is DTORCH_TIMEOUT or dt.init(timeout=...))")
            self._raise_if_dead()

    def _send_failed(self, rank: int, exc: BaseException) -> None:
        if not self._closing:
            self._mark_dead(rank, self._exit_reason(rank, wait=1.0) or f"its channel broke: {exc!r}")

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
                if reason is None and rank not in self._dead:
                    stuck = self.senders[rank].stuck_for()
                    if stuck > self.timeout:
                        reason = (f"it took nothing from its channel for {stuck:.0f}s (pid {self.procs[rank].pid} "
                                  "is stopped or hung; the timeout is DTORCH_TIMEOUT or dt.init(timeout=...))")
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
        """Stop the workers; every step is bounded (a stopped or hung worker is killed)."""
        if self._closing:
            return
        self._closing = True
        grace = min(5.0, max(1.0, self.timeout))
        for rank, sender in enumerate(self.senders):
            if rank in self._dead:  # lost (stopped, hung, broken channel): nothing to wait for
                _kill(self.procs[rank])
                continue
            try:
                sender.send(SHUTDOWN, 0.0)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.debug("killing a worker that did not stop", rank=rank, pid=proc.pid)
                _kill(proc)
        # a sender blocked on a dead worker's channel ends as soon as the channel sees it gone
        ended = {rank for rank, sender in enumerate(self.senders) if sender.stop(2.0)}
        for rank, channel in enumerate(self.to_workers):
            if rank in ended or rank >= len(self.senders):
                _close(channel)
        for channel in self.from_workers:
            _close(channel)
        # drop the channels: native ones still referenced when the interpreter ends are reported
        # as leaks by nanobind
        self.to_workers, self.from_workers, self.senders = [], [], []
        remove_dir(self._rdv)
        _live_runners.discard(self)


def _kill(proc) -> None:
    try:
        proc.kill()  # also ends a stopped (SIGSTOP) process
        proc.wait(5)
    except Exception:
        pass


def _close(channel) -> None:
    try:
        channel.close()
    except Exception:
        pass


_live_runners: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_workers_at_exit() -> None:
    for runner in list(_live_runners):
        try:
            runner.shutdown()
        except Exception:
            pass
