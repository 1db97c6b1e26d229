"""``dtorch worker``: one worker of a remote session, connected to its controller over ZMQ.

It says hello (authenticated with the key file), gets its configuration in the controller's
``WELCOME`` (world size, rendezvous, its node), joins the torch.distributed group, and then runs
the core's worker loop (:class:`dtorch_core.worker.loop.Worker`) on the batches that arrive,
exactly as a ``process`` runner worker does. With one copy per node (``node.py``) a node's
leader keeps the ZMQ connection and hands batches to the node's other workers (followers)
through shared memory; a follower's batches and replies go through its leader. It exits when told to, when the controller refuses it, and
when the controller has been silent for ``--controller-timeout`` seconds (10 by default), so no
worker outlives its controller by more than that.
"""

from __future__ import annotations

import functools
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

from dtorch_core.transport.base import DEFAULT_SPIN_US

from . import frames as fr
from .keys import frame_key, read_key
from .node import FollowerEndpoint
from .transport import (
    PING_EVERY_S,
    WINDOW_BYTES,
    IOLoop,
    Outgoing,
    new_context,
    quiet_socket,
)

CONTROLLER_GONE = 3  # exit status, as the process runner's workers use
REFUSED_EXIT = 4
BYE_GRACE_S = 3.0  # a worker told to exit that is still busy this long later exits at once
CREDIT_EVERY = 64  # batches between credit reports while batches keep coming
CREDIT_IDLE_S = 0.02  # and once the queue has been dry this long with batches taken but not reported
CREDIT_BYTES = WINDOW_BYTES // 8  # and once this many bytes were taken since the last report


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


def node_id(explicit: str | None = None) -> str:
    """The node this worker reports: ``DTORCH_NODE_ID`` (tests simulate nodes with it), else the host name."""
    return explicit or os.environ.get("DTORCH_NODE_ID", "").strip() or socket.gethostname()


def _native_path() -> str:
    """What ``dtorch_core.worker.native.active()`` says in this process ("native", or "python (why)")."""
    from dtorch_core.worker.native import active

    return active()


def _shm_available() -> bool:
    from dtorch_core.transport.channel import native_available

    return native_available()


class WorkerEndpoint:
    """The worker's DEALER socket and its I/O thread; batches arrive on :attr:`inbox`.

    A node leader's endpoint has :attr:`node` (a :class:`~.node.NodeLeader`): its I/O thread
    hands each batch to the followers as it arrives, before the leader's own queue.
    """

    def __init__(self, address: str, key: bytes, rank: int, silence_s: float, connect_s: float,
                 node: str | None = None, on_gone=None):
        self.mac = fr.Mac(key)
        self.rank = rank
        self.node = None
        self._on_gone = on_gone or _exit_gone
        self._closing = False
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
        hello = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "node": node_id(node),
                 "shm": _shm_available(), "native": _native_path()}
        self.send(fr.HELLO, [json.dumps(hello).encode()])  # first: it takes sequence number 0
        self.loop.start()

    def send(self, kind: int, parts) -> None:
        with self._send_lock:
            seq = self._send_seq
            self._send_seq += 1
            head, *rest = fr.seal(self.mac, fr.TO_CONTROLLER, kind, seq, self.nonce, parts)
            self.loop.send(Outgoing([(None, head)], rest))

    def credit(self, taken: int) -> None:
        """Tell the controller how many batches this worker has taken (its node's minimum, as leader)."""
        if self.node is not None:
            self.node.credit(self.rank, taken)
        else:
            self.send(fr.CREDIT, [taken.to_bytes(8, "little")])

    def _received(self, frames) -> None:
        try:
            kind, _, _ = fr.peek(frames)
            if kind == fr.REFUSED:  # unauthenticated by nature: the controller could not trust us
                self.inbox.put((fr.REFUSED, bytes(fr.joined(fr.received_parts(frames))).decode(errors="replace")))
                return
            kind, parts = fr.open_message(self.mac, fr.TO_WORKER, frames, self._recv_seq, self.nonce)
        except fr.FrameError as exc:
            _say(f"dtorch worker: ignored a frame from the controller side: {exc}")
            return
        self._recv_seq += 1
        self._last_heard = time.monotonic()
        self.welcomed = True
        if kind in (fr.BATCH, fr.NODE_BATCH):
            try:
                data = fr.joined(parts) if self.node is None else self.node.forward(kind, parts)
            except Exception as exc:  # noqa: BLE001 - authenticated but malformed: the main loop answers
                data = memoryview(b"\x00" + str(exc).encode())
            if is_shutdown(data):  # told to exit: even if the main thread is stuck
                _bye_timer(self.address)
            self.inbox.put((fr.BATCH, data))
        elif kind == fr.WELCOME:
            self.inbox.put((kind, fr.joined(parts)))

    def _tick(self, now: float) -> None:
        if self.node is not None:
            self.node.tick(now)
        if now - self._last_ping >= PING_EVERY_S:
            self._last_ping = now
            self.send(fr.PING, [b""])
        silent = now - self._last_heard
        if silent > (self.silence_s if self.welcomed else self.connect_s) and not self._closing:
            # from this thread: the main one may be inside a collective that never ends now
            what = "was silent" if self.welcomed else "did not answer"
            self._last_heard = float("inf")  # once
            self._on_gone(f"the controller at {self.address} {what} for {silent:.0f}s")

    def _loop_died(self, exc: BaseException) -> None:
        if not self._closing:  # a loop that outlived close()'s wait fails on the closed socket
            self._on_gone(f"its connection thread failed ({exc!r})")

    def close(self) -> None:
        self._closing = True
        if self.node is not None:  # the followers' goodbyes go out through this connection
            self.node.wait_followers(BYE_GRACE_S)
            self.node.close()
        self.loop.stop()
        self.loop.sock.close()  # lingers until queued frames are out (at most 2 s)
        self.context.term()


def is_shutdown(data) -> bool:
    """Whether a batch message is the request to exit (an empty frame)."""
    return type(data) is not tuple and len(data) == 0


def _bye_timer(address: str) -> None:
    timer = threading.Timer(BYE_GRACE_S, _exit_stuck, args=(address,))
    timer.daemon = True  # a worker that exits normally does not wait for it
    timer.start()


def _exit_gone(why: str) -> None:
    # from an I/O thread: the main one may be inside a collective that never ends now
    _say(f"dtorch worker (pid {os.getpid()}): {why}; exiting")
    os._exit(CONTROLLER_GONE)


def _exit_stuck(address: str) -> None:
    _say(f"dtorch worker (pid {os.getpid()}): told to exit by {address}, still busy after {BYE_GRACE_S:g}s "
         "(a collective with a lost peer?); exiting")
    os._exit(CONTROLLER_GONE)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def serve(address: str, key_file: str, rank: int, device_index: int | None = None,
          silence_s: float = 10.0, connect_s: float = 120.0) -> int:
    endpoint, config = connect(address, frame_key(read_key(key_file)), rank, silence_s, connect_s)
    if endpoint is None:
        return config
    try:
        code = _run(endpoint, config, address, device_index)
    finally:
        endpoint.close()
    # The goodbye is out and nothing is left to do. Exit now: at interpreter exit the gloo
    # process group's destructor waits for its peers (seconds each on a busy host), which made a
    # session's shutdown take 5-13 s and tripped the told-to-exit timer.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def connect(address: str, key: bytes, rank: int, silence_s: float, connect_s: float, node: str | None = None,
            on_gone=None):
    """Say hello and take the ``WELCOME``: (the endpoint batches come from, the configuration),
    or (None, exit code) when the controller refused or never answered. A follower's endpoint
    is its leader's channels (its own ZMQ connection is closed here)."""
    endpoint = WorkerEndpoint(address, key, rank, silence_s, connect_s, node, on_gone)
    kind, value = endpoint.inbox.get()
    if kind != fr.WELCOME:
        endpoint.close()
        return None, _ended(kind, value, rank)
    config = json.loads(bytes(value))
    place = config.get("node")
    if place is None:
        return endpoint, config
    from .node import NodeLeader

    # more workers than cores on the node: a waiting end that spins takes a core another needs
    spin = 0.0 if int(place["size"]) >= (os.cpu_count() or 1) else DEFAULT_SPIN_US
    try:
        if place["leader"] == rank:
            leader = NodeLeader(rank, place["followers"], endpoint.send, float(config["heartbeat_s"]),
                                float(config["timeout"]), spin)
            if leader.followers:  # their channels exist: the controller welcomes them now
                endpoint.send(fr.NODE_UP, [b""])
            leader.start()
            endpoint.node = leader  # only now: the I/O thread ticks it
            return endpoint, config
        follower = FollowerEndpoint(rank, place["down"], place["up"], silence_s, connect_s, spin,
                                    on_gone or _exit_gone, on_bye=lambda: _bye_timer(address))
    except BaseException:
        endpoint.close()
        raise
    endpoint.close()  # from now on the leader's connection carries this worker's traffic
    return follower, config


def serve_batches(endpoint, rank: int, execute, reply) -> int:
    """Run what arrives until told to exit: credit every :data:`CREDIT_EVERY` batches or
    :data:`CREDIT_BYTES` bytes, and when the queue has been dry for :data:`CREDIT_IDLE_S` with batches not yet reported; a
    goodbye at the end. Returns the exit code.

    So the controller, whose window (``transport.WINDOW_BATCHES`` / ``WINDOW_BYTES``) is far
    larger than ``CREDIT_EVERY`` batches, never waits on a worker that is waiting for batches for
    longer than ``CREDIT_IDLE_S``, and a worker that is busy, or that gets batches faster than
    that, reports once per ``CREDIT_EVERY`` batches instead of once per batch."""
    from dtorch_core.ir.instructions import Reply

    from .runner import GOODBYE

    taken = reported = unreported = 0
    inbox = endpoint.inbox
    while True:
        if taken == reported:
            kind, data = inbox.get()
        else:
            try:
                kind, data = inbox.get(timeout=CREDIT_IDLE_S)
            except queue.Empty:
                endpoint.credit(taken)
                reported, unreported = taken, 0
                kind, data = inbox.get()
        if kind != fr.BATCH:
            return _ended(kind, data, rank)
        taken += 1
        unreported += len(data) if type(data) is not tuple else sum(len(p) for p in data if p is not None)
        if taken - reported >= CREDIT_EVERY or unreported >= CREDIT_BYTES:
            endpoint.credit(taken)
            reported, unreported = taken, 0
        if is_shutdown(data):
            reply(Reply(GOODBYE, rank, value=None))
            return 0
        execute(data)


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

    from dtorch_core.controller.heap import freeze_worker
    from dtorch_core.ir import wire
    from dtorch_core.ir.instructions import Reply
    from dtorch_core.logging import configure
    from dtorch_core.plugins import get_plugins
    from dtorch_core.runners.process import READY
    from dtorch_core.worker.loop import Worker
    from dtorch_core.worker.streams import make_streams
    from dtorch_core.worker_main import run_frame

    from .fanout import decode_local
    from .runner import parse_address

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
    freeze_worker()
    reply(Reply(READY, rank, value=None))
    log.debug("worker ready", controller=address)
    decode = functools.partial(decode_local, rank=rank)
    code = serve_batches(endpoint, rank, lambda data: run_frame(worker, streams, data, rank, reply, decode), reply)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - exiting anyway
        log.debug("destroy_process_group failed", error=repr(exc))
    return code
