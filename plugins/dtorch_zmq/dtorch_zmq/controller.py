"""The controller's end of the ZMQ transport: one ROUTER socket, one connection per worker.

A connection starts with the worker's authenticated ``HELLO`` (its rank, pid and host); from
then on every frame must carry the next sequence number of that connection and a valid HMAC.
Anything else is refused: logged with the peer's address, answered with ``REFUSED`` (so the
worker can say why it stops), and reported to ``on_refused``. Both ends ping each other every
second; a worker silent for ``heartbeat_s`` is reported to ``on_lost``. A follower of a node
(``node.py``) is *relayed*: its leader's connection carries its traffic and reports it ``LOST``
(a follower silent or gone on its node); a lost leader makes its followers lost too. A leader's
``NODE_UP`` (its followers' channels exist) goes to ``on_node_up``.
"""

from __future__ import annotations

import json
import threading
import time

import attrs
import structlog
import zmq

from . import frames as fr
from .transport import PING_EVERY_S, Credit, IOLoop, Outgoing, new_context, quiet_socket

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Connection:
    identity: bytes
    nonce: bytes
    rank: int
    peer: str
    pid: int
    host: str
    recv_seq: int = 1  # the HELLO was 0
    send_seq: int = 0
    last_seen: float = 0.0
    hello_at: float = 0.0  # when its HELLO arrived (time.monotonic)
    credit: Credit = attrs.field(factory=Credit)
    lost: bool = False
    node: str = ""  # what the worker reported (DTORCH_NODE_ID, else its host name)
    shm: bool = False  # whether it can use the native shared-memory channels
    native: str = ""  # the worker's per-op path and decoder (dtorch_core.worker.native.active())
    leader: int | None = None  # a follower: the rank whose connection relays it
    followers: tuple = ()  # a leader: the ranks it relays


class ControllerEndpoint:
    """Binds ``address``; calls ``on_hello(conn)``, ``on_reply(conn, data)``,
    ``on_lost(conn, reason)``, ``on_refused(peer, reason)`` and ``on_node_up(conn)`` from its I/O thread."""

    def __init__(self, address: str, key: bytes, world_size: int, *, on_hello, on_reply, on_lost,
                 on_refused, on_node_up=None, heartbeat_s: float = 5.0):
        self._mac = fr.Mac(key)
        self._world_size = world_size
        self._on_hello, self._on_reply = on_hello, on_reply
        self._on_lost, self._on_refused = on_lost, on_refused
        self._on_node_up = on_node_up
        self.heartbeat_s = heartbeat_s
        self.by_identity: dict[bytes, Connection] = {}
        self.by_rank: dict[int, Connection] = {}
        self._seen_nonces: set[bytes] = set()
        self._last_ping = 0.0
        self.batch_bytes = 0  # every frame of every batch sent (tests and the scale bench read it)
        self.batches_sent = 0
        self._send_lock = threading.Lock()  # a sequence number and its place in the queue go together
        self.context = new_context()
        sock = quiet_socket(self.context, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises instead of dropping
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(0)
            self.context.term()
            from dtorch_core.errors import ConfigError

            raise ConfigError(f"listen={address!r}: cannot bind ({exc}); use tcp://HOST:PORT with a free port") from None
        self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.loop = IOLoop(self.context, sock, self._received, self._tick, "dtorch-zmq-controller",
                           on_error=self._loop_died)
        self.loop.start()

    # -- sending (any thread) -------------------------------------------------------------
    def send(self, conn: Connection, kind: int, parts, wake: bool = True) -> Outgoing:
        """Queue one message to ``conn``."""
        return self.send_to([conn], kind, fr.Payload(parts), wake)

    def send_to(self, conns, kind: int, payload: fr.Payload, wake: bool = True) -> Outgoing:
        """Queue one message to each of ``conns`` (a batch to every node): the payload is
        prepared once and shared; each connection gets its own head (sequence number, MAC).
        ``wake=False``: the caller calls ``loop.wake()``."""
        with self._send_lock:
            heads = []
            for conn in conns:
                seq = conn.send_seq
                conn.send_seq = seq + 1
                heads.append((conn.identity, fr.head(self._mac, fr.TO_WORKER, kind, seq, conn.nonce, payload)))
            if kind in (fr.BATCH, fr.NODE_BATCH):
                self.batch_bytes += len(heads) * (fr.HEAD_BYTES + payload.nbytes)
                self.batches_sent += len(heads)
            return self.loop.send(Outgoing(heads, payload.rest), wake)

    # -- receiving (I/O thread) -----------------------------------------------------------
    def _received(self, frames) -> None:
        identity, body = frames[0].bytes, frames[1:]
        conn = self.by_identity.get(identity)
        try:
            if conn is None:
                self._hello(identity, body)
                return
            kind, parts = fr.open_message(self._mac, fr.TO_CONTROLLER, body, conn.recv_seq, conn.nonce)
        except fr.FrameError as exc:
            self._refuse(identity, body, str(exc), conn)
            return
        conn.recv_seq += 1
        conn.last_seen = time.monotonic()
        if kind == fr.REPLY:
            self._on_reply(conn, fr.joined(parts))
        elif kind == fr.CREDIT:
            conn.credit.taken_upto(int.from_bytes(fr.joined(parts), "little"))
        elif kind == fr.LOST:
            self._follower_lost(conn, parts)
        elif kind == fr.NODE_UP and self._on_node_up is not None:
            self._on_node_up(conn)

    def _follower_lost(self, leader: Connection, parts) -> None:
        try:
            info = json.loads(bytes(fr.joined(parts)))
            rank, reason = int(info["rank"]), str(info["reason"])
        except (ValueError, KeyError, TypeError, IndexError):
            rank, reason = -1, ""
        follower = self.by_rank.get(rank)
        if follower is None or rank not in leader.followers:
            log.warning("a leader reported a rank it does not relay", leader=leader.rank, rank=rank)
        elif not follower.lost:
            self._lose(follower, f"{reason} (reported by its node leader, rank {leader.rank})")

    def _hello(self, identity: bytes, body) -> None:
        kind, _, nonce = fr.peek(body)
        if nonce in self._seen_nonces:
            raise fr.FrameError("replayed hello (its connection nonce was used before)")
        kind, parts = fr.open_message(self._mac, fr.TO_CONTROLLER, body, 0, None)
        if kind != fr.HELLO:
            raise fr.FrameError(f"a new connection began with {fr.KIND_NAMES[kind]}, not hello")
        try:
            info = json.loads(bytes(fr.joined(parts)))
            rank, pid, host = int(info["rank"]), int(info["pid"]), str(info["host"])
            node, shm = str(info.get("node") or host), bool(info.get("shm", False))
            native = str(info.get("native", ""))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise fr.FrameError(f"malformed hello ({exc})") from None
        self._seen_nonces.add(nonce)
        now = time.monotonic()
        conn = Connection(identity, nonce, rank, _peer(body), pid, host, last_seen=now, hello_at=now, node=node,
                          shm=shm, native=native)
        if not 0 <= rank < self._world_size or rank in self.by_rank:
            why = (f"rank {rank} is out of range for world size {self._world_size}"
                   if not 0 <= rank < self._world_size else f"rank {rank} is already connected")
            conn.send_seq = 0
            self.by_identity[identity] = conn  # to answer it; it never becomes a worker
            self.send(conn, fr.REFUSED, [why.encode()])
            del self.by_identity[identity]
            self._on_refused(conn.peer, why)
            return
        self.by_identity[identity] = conn
        self.by_rank[rank] = conn
        self._on_hello(conn)

    def _refuse(self, identity: bytes, body, reason: str, conn: Connection | None) -> None:
        peer = _peer(body)
        log.warning("refused a frame", peer=peer, reason=reason, rank=None if conn is None else conn.rank)
        self.loop.send(Outgoing([(identity, fr.refusal(reason))]))
        if conn is not None:  # its stream cannot be trusted any more
            self._lose(conn, f"it sent a frame that was refused ({reason}) from {peer}")
        self._on_refused(peer, reason)

    def _tick(self, now: float) -> None:
        if now - self._last_ping >= PING_EVERY_S:
            self._last_ping = now
            for conn in list(self.by_rank.values()):
                if not conn.lost and conn.leader is None:
                    self.send(conn, fr.PING, [b""])
        for conn in list(self.by_rank.values()):
            silent = now - conn.last_seen
            if not conn.lost and conn.leader is None and silent > self.heartbeat_s:
                self._lose(conn, f"no heartbeat for {silent:.1f}s from {conn.peer} (pid {conn.pid} on {conn.host}): "
                                 "it died, hangs with the GIL held, or the network is cut")

    def _lose(self, conn: Connection, reason: str) -> None:
        conn.lost = True
        conn.credit.wake()
        self._on_lost(conn, reason)
        for rank in conn.followers:
            follower = self.by_rank.get(rank)
            if follower is not None and not follower.lost:
                self._lose(follower, f"its node leader (rank {conn.rank}) is lost: {reason}")

    def _loop_died(self, exc: BaseException) -> None:
        log.error("the controller's ZMQ thread failed", error=repr(exc))
        for conn in list(self.by_rank.values()):
            if not conn.lost:
                self._lose(conn, f"the controller's connection thread failed ({exc!r})")

    def close(self) -> None:
        self.loop.stop()
        self.loop.sock.close(0)
        self.context.term()


def _peer(body) -> str:
    try:
        return body[0].get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError, IndexError):
        return "?"
