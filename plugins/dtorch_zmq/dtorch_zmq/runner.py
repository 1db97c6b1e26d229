r"""The ``remote`` runner: workers on any host, reached over ZMQ (launcher or agent mode).

Launcher mode: ``dt.init(world_size=N, runner="remote", listen="tcp://HOST:PORT",
key_file=FILE)`` binds and waits for N workers that something else started (torchrun, Slurm,
Kubernetes) as ``dtorch worker --controller tcp://HOST:PORT --key-file FILE --rank R``. Agent
mode (``agents=[...]``) asks ``dtorch agent`` services to start those same commands, then waits
the same way.

The torch.distributed rendezvous of the workers is a TCPStore the controller hosts for the
session, bound to the listen address's interface on a free port. Its port and a random key
prefix reach the workers only inside the authenticated ``WELCOME``; workers join through a
PrefixStore with that prefix, and the store closes at ``dt.shutdown()``. (A TCPStore has no
authentication of its own: what it holds is rendezvous data only, under an unguessable prefix.)

One copy per node (``fanout=True``, the default; ``DTORCH_FANOUT=0`` turns it off): the
``WELCOME`` messages go out once every worker said hello, each naming the worker's node (a
leader's at once, its followers' when the leader says their channels exist, ``NODE_UP``), and
every batch is encoded once and sent once per node, to its leader (``fanout.py``, ``node.py``).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import secrets
import socket
import time
from urllib.parse import urlsplit

import attrs
import structlog
import torch.distributed as dist

from dtorch_core.comm.kinds import choose_communicator
from dtorch_core.controller.session import FlushPolicy
from dtorch_core.controller.settings import setting
from dtorch_core.errors import ConfigError, WorkerError, WorkerLostError
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Reply
from dtorch_core.runners.base import Runner
from dtorch_core.runners.process import PROTOCOL, READY, for_rank

from . import frames as fr
from .controller import ControllerEndpoint
from .errors import AgentsUnavailableError, AuthenticationError, WorkersMissingError
from .fanout import encoded_frames, has_rank_parts, node_parts, split_batch
from .keys import frame_key, read_key

log = structlog.get_logger(__name__)

GOODBYE = -2  # request id of the reply a worker sends as it exits
DEFAULT_STARTUP_S = 120.0
DEFAULT_LEASE_S = 30.0

# Each batch costs the controller a fixed ~10-15 us per message it sends (one per node, or per
# worker without fanout: libzmq's TCP write, the I/O thread's send, the head frame and the credit).
# Up to SMALL_MESH messages the base policy's batches (256 ops or 2 ms) keep that under ~2 us per
# op; beyond it batches and the timer grow in proportion, and the timer flushes only after a tick
# without new ops: with a timer alone, a controller slowed by its sends ended every batch at the
# timer, far below the size (controller_scale.py at 512 workers: 102-164 ops in 4 ms, 45 us/op;
# with when_idle 341 ops, 18 us/op). The price: ops a busy controller issues leave at the size
# or at its first pause (sync points flush at once whatever the policy). Past MAX_SCALE the wait
# would be felt: a relay tree's job.
BASE_FLUSH_POLICY = FlushPolicy(batch_size=256, interval=0.002, when_idle=False, first_batch=4)
SMALL_MESH = 32
MAX_SCALE = 16


def flush_policy_for(messages: int) -> FlushPolicy:
    """The session's flush policy when every batch goes out as ``messages`` ZMQ messages."""
    scale = min(MAX_SCALE, max(1.0, messages / SMALL_MESH))
    return attrs.evolve(BASE_FLUSH_POLICY, batch_size=round(BASE_FLUSH_POLICY.batch_size * scale),
                        interval=BASE_FLUSH_POLICY.interval * scale, when_idle=scale > 1)


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT``; ConfigError otherwise."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ConfigError(f"{address!r} is not a ZMQ address of the form tcp://HOST:PORT")
    return parts.hostname, port


class RemoteRunner(Runner):
    name = "remote"
    collective_hints = True  # the workers' DistExchange moves payloads without headers
    flush_policy = BASE_FLUSH_POLICY  # until the workers are known; then flush_policy_for their messages

    def __init__(self, world_size: int, device_type: str = "cpu", timeout: float = 300.0, *, plugins,
                 listen: str | None = None, key_file: str | None = None, agents=None,
                 startup_timeout: float | None = None, heartbeat_timeout: float | None = None,
                 communicator: str | None = None, dist_backend: str | None = None, lease_s: float | None = None,
                 fanout: bool | None = None, **_options):
        communicator, chosen = choose_communicator(plugins.registry("communicators"), "process", device_type,
                                                   communicator)
        super().__init__(world_size, device_type, plugins)
        self.timeout = timeout
        self._closing = False
        self._refused: list[AuthenticationError] = []
        self._protocol_errors: list = []
        self._agent_handles: list = []
        key = read_key(key_file or os.environ.get("DTORCH_KEY_FILE"))
        agents = _agent_list(agents)
        listen = listen or os.environ.get("DTORCH_LISTEN") or ("tcp://0.0.0.0:0" if agents else None)
        if not listen:
            raise ConfigError("the remote runner needs listen='tcp://HOST:PORT' (or DTORCH_LISTEN) for workers "
                              "started by a launcher, or agents=[...] (DTORCH_AGENTS)")
        host, _ = parse_address(listen)
        startup = setting("startup_timeout", startup_timeout, "DTORCH_STARTUP_TIMEOUT", DEFAULT_STARTUP_S, "seconds")
        beat = setting("heartbeat_timeout", heartbeat_timeout, "DTORCH_HEARTBEAT_TIMEOUT", 5.0, "seconds")
        self._store, store_port = _rendezvous_store(host, world_size, timeout)
        prefix = secrets.token_hex(16)
        self._welcome = {"world_size": world_size, "store_port": store_port, "store_prefix": prefix,
                         "device_type": device_type, "communicator": communicator,
                         "backend": dist_backend or chosen.dist_backend, "timeout": timeout, "heartbeat_s": beat}
        self._conns: dict = {}
        self.fanout = setting("fanout", fanout, "DTORCH_FANOUT", True, "flag")
        self.leaders: list | None = None  # with fanout: the connection of each node's leader, once welcomed
        self._held: dict = {}  # a leader's rank: its followers' WELCOMEs, sent at its NODE_UP
        self.endpoint = ControllerEndpoint(listen, frame_key(key), world_size, on_hello=self._hello,
                                           on_reply=self._reply_frame, on_lost=self._lost,
                                           on_refused=self._refusal, on_node_up=self._node_up, heartbeat_s=beat)
        self.address = self.endpoint.address
        try:
            if agents:
                self._start_on_agents(agents, key, lease_s or DEFAULT_LEASE_S)
            self._wait_for_workers(startup)
        except BaseException:
            self.shutdown()
            raise
        self.flush_policy = flush_policy_for(self.messages_per_batch)
        log.info("remote runner up", world_size=world_size, listen=self.address, nodes=self.messages_per_batch,
                 batch_size=self.flush_policy.batch_size, flush_interval_s=self.flush_policy.interval)

    @property
    def messages_per_batch(self) -> int:
        """ZMQ messages a batch for every rank takes: one per node with fanout, else one per worker."""
        return len(self.leaders) if self.leaders is not None else self.world_size

    # -- start-up -------------------------------------------------------------------------
    def _start_on_agents(self, agents: list[str], key: bytes, lease_s: float) -> None:
        try:
            from . import agent_client
        except ImportError:
            raise AgentsUnavailableError("agents= needs dtorch_zmq.agent_client, which this install does not have; "
                                         "start the workers yourself and use listen= (launcher mode)") from None
        address = self.address
        host, port = parse_address(address)
        if host in ("0.0.0.0", "*"):  # bound to every interface: tell the agents a name they can reach
            address = f"tcp://{socket.getfqdn()}:{port}"
        placed = place_ranks(self.world_size, [agent_client.agent_info(a, key)["devices"] for a in agents], agents)
        for agent, ranks in zip(agents, placed):
            if ranks:
                self._agent_handles.append(agent_client.start_workers(
                    agent, key, address, ranks, lease_s,
                    on_lost=lambda err, ranks=ranks: self._agent_lost(ranks, err)))

    def _agent_lost(self, ranks, error) -> None:
        if not self._closing:
            with self._cond:
                for rank in ranks:
                    self._dead.setdefault(rank, f"its agent is lost: {error}")
                self._cond.notify_all()

    def _wait_for_workers(self, startup: float) -> None:
        deadline = time.monotonic() + startup
        next_log = time.monotonic() + 5.0
        with self._cond:
            while True:
                if self._refused:
                    raise self._refused[0]
                ready = len(self._replies.get(READY, ()))
                if self._dead:
                    self._raise_if_dead()
                if ready >= self.world_size:
                    self._replies.pop(READY)
                    return
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(range(self.world_size)) - {c.rank for c in self._conns.values()})
                    raise WorkersMissingError(
                        f"{ready} of {self.world_size} workers ready after {startup:g}s at {self.address}; "
                        f"never connected: ranks {missing} (start them as `dtorch worker --controller "
                        f"{self.address} --key-file FILE --rank R`; DTORCH_STARTUP_TIMEOUT sets the wait)")
                if now >= next_log:
                    next_log = now + 5.0
                    log.info("waiting for workers", connected=len(self._conns), ready=ready,
                             world_size=self.world_size, listen=self.address)
                self._cond.wait(min(0.2, deadline - now))

    # -- the endpoint's callbacks (its I/O thread) -----------------------------------------
    def _hello(self, conn) -> None:
        with self._cond:
            self._conns[conn.rank] = conn
            everyone = len(self._conns) == self.world_size
        log.info("worker connected", rank=conn.rank, peer=conn.peer, host=conn.host, node=conn.node, pid=conn.pid)
        if not self.fanout:
            self.endpoint.send(conn, fr.WELCOME, [json.dumps(dict(self._welcome, rank=conn.rank)).encode()])
        elif everyone:  # the nodes are known once every worker said where it runs
            self.leaders = [self._conns[node[0]] for node in node_groups(self._conns)]
            now = []
            for rank, place in node_places(self._conns).items():
                message = (self._conns[rank], [json.dumps(dict(self._welcome, rank=rank, node=place)).encode()])
                if place["leader"] == rank:
                    now.append(message)
                else:  # a follower opens its leader's channels at once: welcomed once they exist
                    self._held.setdefault(place["leader"], []).append(message)
            self._welcome_all(now)

    def _node_up(self, conn) -> None:
        """A leader made its followers' channels (``NODE_UP``): their WELCOMEs go now (I/O thread)."""
        self._welcome_all(self._held.pop(conn.rank, ()))

    def _welcome_all(self, messages) -> None:
        for conn, parts in messages:
            self.endpoint.send(conn, fr.WELCOME, parts, wake=False)
        self.endpoint.loop.wake()

    def _reply_frame(self, conn, data) -> None:
        try:
            reply = wire.decode(data)
        except Exception as exc:  # noqa: BLE001 - an authenticated but broken worker
            self._lost(conn, f"it sent an undecodable reply ({exc})")
            return
        if not isinstance(reply, Reply):
            self._lost(conn, f"it sent {type(reply).__name__} instead of a reply")
        elif reply.request_id == PROTOCOL:
            with self._cond:
                self._protocol_errors.append(reply.error)
                self._cond.notify_all()
        else:
            self._reply(reply)

    def _lost(self, conn, reason: str) -> None:
        if not self._closing:
            log.warning("worker lost", rank=conn.rank, reason=reason)
            with self._cond:
                self._dead.setdefault(conn.rank, reason)
                self._cond.notify_all()

    def _refusal(self, peer: str, reason: str) -> None:
        err = AuthenticationError(f"refused a worker connection from {peer}: {reason}; every worker needs the "
                                  "controller's key file (--key-file, made by `dtorch keygen`)", peer=peer)
        with self._cond:
            self._refused.append(err)
            self._cond.notify_all()

    # -- the session's calls --------------------------------------------------------------
    def submit(self, batch) -> None:
        self._raise_if_dead()
        if self.leaders is not None:
            return self._submit_per_node(batch)
        shared = None
        if not has_rank_parts(batch):
            shared = fr.Payload(encoded_frames(batch))  # every rank gets the same frames
        pending = []
        for rank in range(self.world_size):
            payload = shared if shared is not None else fr.Payload(encoded_frames(for_rank(batch, rank)))
            conn = self._conns[rank]
            if not conn.credit.acquire(payload.nbytes, self.timeout, functools.partial(self._gone, conn)):
                self._lost(conn, f"it took no batch for {self.timeout:g}s (flow-control window full)")
                break
            pending.append(self.endpoint.send_to([conn], fr.BATCH, payload))
        self._wait_sent(pending)

    def _submit_per_node(self, batch) -> None:
        """One copy per node: the batch encoded once, its rank parts (if any) to their nodes only."""
        if not has_rank_parts(batch):  # one payload for every node: one queued message for all
            messages = [(self.leaders, fr.BATCH, fr.Payload(encoded_frames(batch)))]
        else:
            common, by_rank = split_batch(batch)
            common = encoded_frames(common)
            ranked = {rank: encoded_frames(part) for rank, part in by_rank.items()}
            messages = [([leader], fr.NODE_BATCH, fr.Payload(node_parts(
                common, [(r, ranked[r]) for r in (leader.rank,) + leader.followers if r in ranked])))
                for leader in self.leaders]
        pending = []
        try:
            for leaders, kind, payload in messages:
                room = []
                for leader in leaders:
                    if not leader.credit.acquire(payload.nbytes, self.timeout, functools.partial(self._gone, leader)):
                        self._lost(leader, f"its node took no batch for {self.timeout:g}s (flow-control window full)")
                        break
                    room.append(leader)
                pending.append(self.endpoint.send_to(room, kind, payload, wake=False))
                if len(room) < len(leaders):
                    break
        finally:
            self.endpoint.loop.wake()  # once for the batch's messages to every node
        self._wait_sent(pending)

    def _wait_sent(self, pending) -> None:
        for out in pending:  # tensor parts alias the caller's tensors: return once ZMQ let go of them
            if out.sent is not None and not out.sent.wait(self.timeout):
                raise WorkerLostError(f"a batch was not sent within {self.timeout:g}s (the network is stuck)")
        self._raise_if_dead()

    def _gone(self, conn) -> bool:
        return conn.lost or self._closing

    def _raise_if_dead(self) -> None:
        if self._dead:
            rank, reason = min(self._dead.items())
            raise WorkerLostError(f"worker rank {rank} (remote runner) is lost: {reason}; call dt.shutdown() "
                                  "and start again")

    def wait_replies(self, request_id: int, count: int, timeout: float) -> list:
        replies = super().wait_replies(request_id, count, timeout)
        with self._cond:
            if self._protocol_errors:
                f = self._protocol_errors.pop(0)
                raise WorkerError(f"worker rank {f.rank} rejected a batch: {f.message}", rank=f.rank, op=f.op,
                                  source=None)
        return replies

    # -- shutdown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask every worker to exit and wait (a few seconds) until each said goodbye."""
        if self._closing:
            return
        self._closing = True
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            live = [c for c in self._conns.values() if not c.lost]
            for conn in live:
                if conn.leader is None:  # a leader hands it to its followers
                    endpoint.send(conn, fr.BATCH, [b""])
            with self._cond:
                if not self._cond.wait_for(lambda: len(self._replies.get(GOODBYE, ())) >= len(live), 5.0):
                    log.warning("not every worker said goodbye within 5s", expected=len(live),
                                got=len(self._replies.get(GOODBYE, ())))
            endpoint.close()
        for handle in self._agent_handles:
            stop = getattr(handle, "stop", None)
            if stop is not None:
                try:
                    stop()
                except Exception as exc:  # noqa: BLE001 - the lease ends them anyway
                    log.warning("could not stop an agent's workers", error=repr(exc))
        self._store = None  # the last reference: the store's server closes


def node_groups(conns: dict) -> list[tuple]:
    """The ranks of each node, lowest first (the leader); a worker without shared memory is a
    node of its own."""
    groups: dict = {}
    for rank in sorted(conns):
        conn = conns[rank]
        groups.setdefault(conn.node if conn.shm else ("alone", rank), []).append(rank)
    return sorted(tuple(g) for g in groups.values())


def node_places(conns: dict) -> dict[int, dict]:
    """Each rank's ``node`` section of its ``WELCOME``; marks the connections as leader and followers."""
    places = {}
    for ranks in node_groups(conns):
        leader, followers = ranks[0], ranks[1:]
        channels = {r: {"down": f"/dtz-{secrets.token_hex(12)}", "up": f"/dtz-{secrets.token_hex(12)}",
                        "pid": conns[r].pid} for r in followers}
        conns[leader].followers = tuple(followers)
        places[leader] = {"leader": leader, "size": len(ranks), "followers": {str(r): c for r, c in channels.items()}}
        for r in followers:
            conns[r].leader = leader
            places[r] = {"leader": leader, "size": len(ranks), "down": channels[r]["down"], "up": channels[r]["up"]}
    return places


def place_ranks(world_size: int, devices: list[int], agents: list[str]) -> list[list[int]]:
    """Contiguous blocks of ranks, one per agent, each at most its devices, filled in order."""
    if sum(devices) < world_size:
        raise ConfigError(f"world_size={world_size} needs more devices than the agents have: "
                          + ", ".join(f"{a}: {d}" for a, d in zip(agents, devices)))
    placed, start = [], 0
    for d in devices:
        placed.append(list(range(start, min(world_size, start + d))))
        start = min(world_size, start + d)
    return placed


def _agent_list(agents) -> list[str]:
    if agents is None:
        agents = os.environ.get("DTORCH_AGENTS", "")
    if isinstance(agents, str):
        agents = [a.strip() for a in agents.split(",") if a.strip()]
    return list(agents)


def _rendezvous_store(host: str, world_size: int, timeout: float):
    """A TCPStore server on a free port of ``host``'s interface (all of them for 0.0.0.0 / *)."""
    bind_host = "" if host in ("*", "0.0.0.0") else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, 0))
        sock.listen(max(64, world_size * 4))
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot open the rendezvous store on {host!r}: {exc}") from None
    store = dist.TCPStore(bind_host or "127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port

