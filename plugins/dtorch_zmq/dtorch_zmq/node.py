"""A node's workers behind one ZMQ connection: the leader's fan-out and the followers' end.

Every worker says ``HELLO`` to the controller itself (authenticated with the key); the
controller answers once all have, and each ``WELCOME`` names the worker's node: the leader (the
lowest rank of the node) gets its followers' ranks, pids and the names of two shared-memory
channels per follower (random, sent only inside the authenticated ``WELCOME``; the rings are
mode 0600 and their names are unlinked once both ends are open, so only the processes the
controller welcomed can hold them). The leader makes the channels and says ``NODE_UP``; only
then are its followers welcomed (so none polls for channels that do not exist yet: at 512
workers on a loaded machine, hundreds of followers retrying held their leaders' GIL for tens
of seconds). A follower opens its two channels and closes its ZMQ connection: from then on the
leader's connection carries the node's traffic.

- Down (leader -> follower): batches as the leader's I/O thread receives them (the same bytes
  for every follower, or the common batch with the follower's own rank part, ``fanout.py``),
  sent in order by a core :class:`~dtorch_core.runners.sending.Sender` per follower, and a
  ping every second.
- Up (follower -> leader): replies (forwarded to the controller as they are), credit (batches
  taken; the leader reports the node's minimum, so the controller's window bounds every
  follower's backlog too) and a ping every second.

A follower whose channel closes (its process died) or that is silent for the heartbeat timeout
is reported to the controller (``LOST``), which raises ``WorkerLostError`` naming its rank. A
follower whose leader is gone (channel closed, or silent) exits, as a worker whose controller is
silent does.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time

from dtorch_core.runners.sending import Sender, SendStalled
from dtorch_core.transport.base import ChannelClosedError, ChannelTimeoutError

from . import fanout
from . import frames as fr

PING_EVERY_S = 1.0
OPEN_RETRY_S = 0.005
RING_BYTES = 1 << 20  # per channel; DTORCH_FANOUT_RING_BYTES (the scale bench makes thousands)


def ring_bytes() -> int:
    raw = os.environ.get("DTORCH_FANOUT_RING_BYTES", "").strip()
    return int(raw) if raw else RING_BYTES


def _shm():
    # the native extension; a HELLO says whether it imports
    from dtorch_core.transport import shm

    return shm.ShmChannel


class _Follower:
    __slots__ = ("down", "last_ping", "last_seen", "lost", "pid", "rank", "reader", "sender", "up")

    def __init__(self, rank: int, pid: int, down, up):
        self.rank, self.pid, self.down, self.up = rank, pid, down, up
        self.sender = None
        self.reader = None
        self.last_seen = time.monotonic()
        self.last_ping = 0.0
        self.lost = False


class NodeLeader:
    """The leader's side: makes the followers' channels, forwards batches, relays what comes up.

    ``send(kind, parts)`` is the leader's own authenticated send to the controller.
    """

    def __init__(self, rank: int, followers: dict, send, heartbeat_s: float, timeout: float, spin_us: float):
        self.rank = rank
        self._send = send
        self.heartbeat_s = heartbeat_s
        self.timeout = timeout
        self.stopping = False
        self._credit_lock = threading.Lock()
        self._taken = {rank: 0}
        self._reported = 0
        self.followers: dict[int, _Follower] = {}
        shm = _shm()
        size = ring_bytes()
        try:
            for key, info in sorted(followers.items(), key=lambda kv: int(kv[0])):
                r = int(key)
                down = shm.create(info["down"], "send", capacity=size, spin_us=spin_us)
                up = shm.create(info["up"], "recv", capacity=size, spin_us=spin_us)
                down.child_started(int(info["pid"]))  # a follower that dies before it opens is seen too
                up.child_started(int(info["pid"]))
                self.followers[r] = _Follower(r, int(info["pid"]), down, up)
                self._taken[r] = 0
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        for f in self.followers.values():
            f.sender = Sender(f.rank, f.down, lambda rank, exc: self.lost(rank, f"its channel broke ({exc!r})"))
            f.reader = threading.Thread(target=self._read, args=(f,), name=f"dtorch-zmq-up-{f.rank}", daemon=True)
            f.reader.start()

    # -- down: the leader's I/O thread --------------------------------------------------------
    def forward(self, kind: int, parts):
        """Hand a batch from the controller to every follower; returns the leader's own data."""
        if kind == fr.BATCH:
            data = fr.joined(parts)
            if len(data) == 0:
                self.stopping = True
            for f in self.followers.values():
                self._down(f, data)
            return data
        common, by_rank = fanout.parse_node_parts(parts)
        common = fr.joined(common)
        for f in self.followers.values():
            mine = by_rank.get(f.rank)
            self._down(f, common if mine is None else fanout.ranked_message(common, fr.joined(mine)))
        mine = by_rank.get(self.rank)
        return (common, None if mine is None else fr.joined(mine))

    def _down(self, f: _Follower, data) -> None:
        if f.lost:
            return
        try:
            f.sender.send(data, self.timeout)
        except SendStalled as exc:
            self.lost(f.rank, f"it took no batch for {self.timeout:g}s ({exc})")

    def tick(self, now: float) -> None:
        for f in self.followers.values():
            if f.lost or self.stopping:
                continue
            if now - f.last_ping >= PING_EVERY_S:
                f.last_ping = now
                self._down(f, fanout.PING)
            silent = now - f.last_seen
            if silent > self.heartbeat_s:
                self.lost(f.rank, f"no heartbeat for {silent:.1f}s through its node leader (rank {self.rank}, pid "
                                  f"{os.getpid()}): pid {f.pid} died, is stopped or hangs with the GIL held")
            elif f.sender.stuck_for() > self.timeout:
                self.lost(f.rank, f"it took nothing from its channel for {f.sender.stuck_for():.0f}s (pid {f.pid})")

    # -- up: one reader thread per follower --------------------------------------------------
    def _read(self, f: _Follower) -> None:
        while True:
            try:
                msg = f.up.recv(0.5)
            except ChannelTimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 - closed: the follower exited (or we close)
                if not self.stopping:
                    self.lost(f.rank, f"its process (pid {f.pid}) exited or closed its channel ({exc})")
                return
            f.last_seen = time.monotonic()
            head = msg[:1]
            if head == fanout.PING:
                continue
            if head == fanout.CREDIT:
                self.credit(f.rank, int.from_bytes(msg[1:9], "little"))
                continue
            self._send(fr.REPLY, [msg])

    def credit(self, rank: int, taken: int) -> None:
        """Batches ``rank`` has taken; the controller hears the node's minimum when it grows."""
        with self._credit_lock:
            if rank not in self._taken:
                return
            self._taken[rank] = taken
            low = min(self._taken.values())
            if low <= self._reported:
                return
            self._reported = low
            self._send(fr.CREDIT, [low.to_bytes(8, "little")])

    def lost(self, rank: int, reason: str) -> None:
        f = self.followers.get(rank)
        if f is None or f.lost or self.stopping:
            return
        f.lost = True
        with self._credit_lock:
            self._taken.pop(rank, None)  # the session fails anyway; do not hold the others back
        self._send(fr.LOST, [json.dumps({"rank": rank, "reason": reason}).encode()])

    # -- the end -------------------------------------------------------------------------------
    def wait_followers(self, timeout: float) -> None:
        """After the goodbye: let each reader relay its follower's goodbye (until its channel closes)."""
        deadline = time.monotonic() + timeout
        for f in self.followers.values():
            if f.sender is not None:
                f.sender.stop(max(0.0, deadline - time.monotonic()))
            if f.reader is not None:
                f.reader.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.stopping = True
        for f in self.followers.values():
            for ch in (f.down, f.up):
                with contextlib.suppress(Exception):  # closing anyway
                    ch.close()


class FollowerEndpoint:
    """A follower's end: the inbox and ``send`` of a worker endpoint, over its leader's channels."""

    def __init__(self, rank: int, down_name: str, up_name: str, silence_s: float, open_s: float, spin_us: float,
                 on_gone, on_bye=None):
        self.rank = rank
        self.inbox: queue.Queue = queue.Queue()
        self.silence_s = silence_s
        self._on_gone = on_gone  # on_gone(why): the leader is gone; the real worker exits
        self._on_bye = on_bye  # on_bye(): told to exit (the real worker starts its grace timer)
        shm = _shm()
        deadline = time.monotonic() + open_s
        self.down = self.up = None
        pause = OPEN_RETRY_S
        while self.up is None:
            try:
                if self.down is None:
                    self.down = shm.open(down_name, "recv", spin_us=spin_us)
                self.up = shm.open(up_name, "send", spin_us=spin_us)
            except (OSError, ValueError, ChannelClosedError) as exc:  # not there, or not set up yet
                if time.monotonic() > deadline:
                    self.close()
                    raise ChannelClosedError(f"the node leader's channels did not appear within {open_s:g}s ({exc})") \
                        from None
                time.sleep(pause)
                pause = min(0.1, pause * 2)  # a node's followers retrying must not starve its leader
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._receive, name=f"dtorch-zmq-down-{rank}", daemon=True)
        self._thread.start()

    def send(self, kind: int, parts) -> None:
        if kind == fr.REPLY:
            self.up.send(fr.joined(parts))
        elif kind == fr.CREDIT:
            self.up.send(fanout.CREDIT + bytes(parts[0]))

    def credit(self, taken: int) -> None:
        self.send(fr.CREDIT, [taken.to_bytes(8, "little")])

    def _receive(self) -> None:
        last_ping = 0.0
        while True:
            now = time.monotonic()
            try:
                if now - last_ping >= PING_EVERY_S:
                    last_ping = now
                    self.up.send(fanout.PING)
                msg = self.down.recv(0.5)
            except ChannelTimeoutError:
                silent = time.monotonic() - self._last_heard
                if silent > self.silence_s:
                    self._on_gone(f"its node leader was silent for {silent:.0f}s")
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - the leader's end closed: it is gone
                self._on_gone(f"its node leader is gone ({exc})")
                return
            self._last_heard = time.monotonic()
            if msg == fanout.PING:
                continue
            self.inbox.put((fr.BATCH, msg))
            if len(msg) == 0:  # told to exit: nothing more comes down
                if self._on_bye is not None:
                    self._on_bye()
                return

    def close(self) -> None:
        for ch in (self.down, self.up):
            if ch is not None:
                with contextlib.suppress(Exception):  # closing anyway
                    ch.close()
