"""``dtorch worker``: one worker of a remote session, connected to its controller over ZMQ.

It says hello (authenticated with the key file), gets its configuration in the controller's
``WELCOME`` (world size, rendezvous), joins the torch.distributed group, and then runs the
core's worker loop (:class:`dtorch_core.worker.loop.Worker`) on the batches that arrive, exactly
as a ``process`` runner worker does. It exits when told to, when the controller refuses it, and
when the controller has been silent for ``--controller-timeout`` seconds (10 by default), so no
worker outlives its controller by more than that.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import sys
import threading
import time
from datetime import timedelta

import zmq

from . import frames as fr
from .keys import frame_key, read_key
from .transport import PING_EVERY_S, IOLoop, Outgoing, new_context, quiet_socket

CONTROLLER_GONE = 3  # exit status, as the process runner's workers use
REFUSED_EXIT = 4
BYE_GRACE_S = 3.0  # a worker told to exit that is still busy this long later exits at once
CREDIT_EVERY = 64  # batches between credit reports (and whenever the queue runs dry)


def worker_rank(explicit: int | None) -> int:
    """``--rank``, else ``RANK``, else ``SLURM_PROCID``."""
    if explicit is not None:
        return explicit
    for name in ("RANK", "SLURM_PROCID"):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise SystemExit(f"dtorch worker: {name}={raw!r} is not a rank") from None
    raise SystemExit("dtorch worker: no rank: pass --rank R or set RANK (torchrun) or SLURM_PROCID (Slurm)")


class WorkerEndpoint:
    """The worker's DEALER socket and its I/O thread; batches arrive on :attr:`inbox`."""

    def __init__(self, address: str, key: bytes, rank: int, silence_s: float, connect_s: float):
        self.key = key
        self.nonce = secrets.token_bytes(16)
        self.inbox: queue.Queue = queue.Queue()
        self.silence_s = silence_s
        self.connect_s = connect_s
        self.welcomed = False
        self.address = address
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._last_ping = 0.0
        self.context = new_context()
        sock = quiet_socket(self.context, zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)  # the goodbye must leave before the process does
        sock.connect(address)
        self.loop = IOLoop(self.context, sock, self._received, self._tick, "dtorch-zmq-worker",
                           on_error=self._loop_died)
        hello = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
        self.send(fr.HELLO, [json.dumps(hello).encode()])  # first: it takes sequence number 0
        self.loop.start()

    def send(self, kind: int, parts) -> None:
        with self._send_lock:
            seq = self._send_seq
            self._send_seq += 1
            self.loop.send(Outgoing(None, fr.seal(self.key, fr.TO_CONTROLLER, kind, seq, self.nonce, parts), False))

    def _received(self, frames) -> None:
        try:
            kind, _, _ = fr.peek(frames)
            if kind == fr.REFUSED:  # unauthenticated by nature: the controller could not trust us
                self.inbox.put((fr.REFUSED, bytes(frames[1].bytes).decode(errors="replace")))
                return
            kind, parts = fr.open_message(self.key, fr.TO_WORKER, frames, self._recv_seq, self.nonce)
        except fr.FrameError as exc:
            _say(f"dtorch worker: ignored a frame from the controller side: {exc}")
            return
        self._recv_seq += 1
        self._last_heard = time.monotonic()
        self.welcomed = True
        if kind in (fr.BATCH, fr.WELCOME):
            data = fr.joined(parts)
            if kind == fr.BATCH and len(data) == 0:  # told to exit: even if the main thread is stuck
                timer = threading.Timer(BYE_GRACE_S, _exit_stuck, args=(self.address,))
                timer.daemon = True  # a worker that exits normally does not wait for it
                timer.start()
            self.inbox.put((kind, data))

    def _tick(self, now: float) -> None:
        if now - self._last_ping >= PING_EVERY_S:
            self._last_ping = now
            self.send(fr.PING, [b""])
        silent = now - self._last_heard
        if silent > (self.silence_s if self.welcomed else self.connect_s):
            # from this thread: the main one may be inside a collective that never ends now
            what = "was silent" if self.welcomed else "did not answer"
            _say(f"dtorch worker (pid {os.getpid()}): the controller at {self.address} {what} for {silent:.0f}s; exiting")
            os._exit(CONTROLLER_GONE)

    def _loop_died(self, exc: BaseException) -> None:
        _say(f"dtorch worker (pid {os.getpid()}): its connection thread failed ({exc!r}); exiting")
        os._exit(CONTROLLER_GONE)

    def close(self) -> None:
        self.loop.stop()
        self.loop.sock.close()  # lingers until queued frames are out (at most 2 s)
        self.context.term()


def _exit_stuck(address: str) -> None:
    _say(f"dtorch worker (pid {os.getpid()}): told to exit by {address}, still busy after {BYE_GRACE_S:g}s "
         "(a collective with a lost peer?); exiting")
    os._exit(CONTROLLER_GONE)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def serve(address: str, key_file: str, rank: int, device_index: int | None = None,
          silence_s: float = 10.0, connect_s: float = 120.0) -> int:
    key = frame_key(read_key(key_file))
    endpoint = WorkerEndpoint(address, key, rank, silence_s, connect_s)
    kind, value = endpoint.inbox.get()
    if kind != fr.WELCOME:
        endpoint.close()
        return _ended(kind, value, rank)
    config = json.loads(bytes(value))
    try:
        return _run(endpoint, config, address, device_index)
    finally:
        endpoint.close()


def _ended(kind, value, rank: int) -> int:
    if kind == fr.REFUSED:
        _say(f"dtorch worker rank {rank}: the controller refused this worker: {value}")
        return REFUSED_EXIT
    _say(f"dtorch worker rank {rank}: {value}; exiting")
    return CONTROLLER_GONE


def _run(endpoint: WorkerEndpoint, config: dict, address: str, device_index: int | None) -> int:
    import structlog
    import torch
    import torch.distributed as dist

    from dtorch_core.ir import wire
    from dtorch_core.ir.instructions import Reply
    from dtorch_core.logging import configure
    from dtorch_core.plugins import get_plugins
    from dtorch_core.runners.process import READY
    from dtorch_core.worker.loop import Worker
    from dtorch_core.worker.streams import make_streams
    from dtorch_core.worker_main import run_frame

    from .runner import GOODBYE, parse_address

    configure()
    rank = config["rank"]
    log = structlog.get_logger("dtorch_zmq.worker").bind(rank=rank)
    host, _ = parse_address(address)
    if host in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a loopback session: gloo's pairs stay on loopback
    if "DTORCH_WORKER_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["DTORCH_WORKER_THREADS"]))
    plugins = get_plugins()
    streams = make_streams(plugins.registry("streams"), config["device_type"],
                           rank if device_index is None else device_index)
    streams.claim_process()
    timeout = timedelta(seconds=float(config["timeout"]))
    store = dist.PrefixStore(config["store_prefix"], dist.TCPStore(host, int(config["store_port"]), None, False, timeout))
    dist.init_process_group(config["backend"], store=store, rank=rank, world_size=config["world_size"],
                            timeout=timeout)

    def reply(r: Reply) -> None:
        endpoint.send(fr.REPLY, fr.payload_parts(wire.encode_parts(r)))

    exchange = plugins.registry("communicators").get(config["communicator"]).create(rank, streams.device)
    worker = Worker(rank, streams.device, plugins.registry("kernels"), exchange, reply, streams)
    reply(Reply(READY, rank, value=None))
    log.debug("worker ready", controller=address)
    taken = reported = 0
    code = 0
    while True:
        kind, data = endpoint.inbox.get()
        if kind != fr.BATCH:
            code = _ended(kind, data, rank)
            break
        taken += 1
        if taken - reported >= CREDIT_EVERY or endpoint.inbox.empty():
            endpoint.send(fr.CREDIT, [taken.to_bytes(8, "little")])
            reported = taken
        if len(data) == 0:
            reply(Reply(GOODBYE, rank, value=None))
            break
        run_frame(worker, streams, data, rank, reply)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - exiting anyway
        log.debug("destroy_process_group failed", error=repr(exc))
    return code
