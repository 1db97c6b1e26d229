"""The ZMQ transport: a ROUTER socket on the controller, a DEALER socket per worker.

ZMQ sockets are not thread-safe, so each end has one I/O thread that owns its socket
(:class:`IOLoop`): other threads queue messages and wake it through a pipe (one ``write(2)``:
an inproc ZMQ pair cost the sending thread 4x more per wake). High-water
marks are off (0) and the ROUTER is mandatory-routing, so ZMQ never drops a message; flow
control is explicit instead: a worker reports how many batches it has taken (``CREDIT``) and the
controller sends at most :data:`WINDOW_BATCHES` batches (and :data:`WINDOW_BYTES`) ahead of it.

A queued :class:`Outgoing` is one message to each of several peers (a batch to every node): each
peer's message is its own head frame, then frames shared by all of them. Those shared frames
(large tensor parts) are ``zmq.Frame`` objects made once, without a copy and tracked: every send
of one is a reference to the same ZMQ message, and ``Outgoing.sent`` is set once ZMQ has let go
of all of them (``IOLoop._in_flight``); the runner's ``submit`` returns only then, so the memory a
tensor part aliases is neither freed nor changed while ZMQ still reads it.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import zmq

WINDOW_BATCHES = 1024
WINDOW_BYTES = 512 << 20
PING_EVERY_S = 1.0


class Outgoing:
    """Queued messages: ``heads`` is ``[(peer identity or None, head frame), ...]``; each peer gets
    its head then ``rest``. ``sent`` (only when there is a ``rest``, whose buffers the caller's
    memory may alias) is set once ZMQ is done with them."""

    __slots__ = ("heads", "rest", "sent", "trackers")

    def __init__(self, heads, rest=()):
        self.heads = heads
        self.rest = [zmq.Frame(p, copy=False, track=True) for p in rest]  # one ZMQ message each, for every peer
        self.trackers = [f.tracker for f in self.rest]
        self.sent = threading.Event() if rest else None

    def done(self) -> None:
        if self.sent is not None:
            self.sent.set()


class IOLoop:
    """Owns one socket; sends what other threads queue and hands what arrives to ``on_frames``.

    ``on_frames(frames)`` and ``on_tick(now)`` run on the I/O thread (``on_tick`` every
    ``tick_s``). ``frames`` are ``zmq.Frame`` objects (no copy of what arrived).
    """

    def __init__(self, context: zmq.Context, sock: zmq.Socket, on_frames, on_tick, name: str,
                 tick_s: float = 0.25, on_error=None):
        self.sock = sock
        self._on_frames = on_frames
        self._on_tick = on_tick
        self._on_error = on_error  # on_error(exc): this loop died (a bug): its end cannot go on
        self._tick_s = tick_s
        self._wake_rx, self._wake_tx = os.pipe()
        os.set_blocking(self._wake_rx, False)
        os.set_blocking(self._wake_tx, False)  # a full pipe already holds a wake
        self._wake_lock = threading.Lock()  # no write to the fd number once stop() closed it
        self._outbox: collections.deque = collections.deque()
        self._in_flight: list[Outgoing] = []
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> IOLoop:
        self._thread.start()
        return self

    def send(self, out: Outgoing, wake: bool = True) -> Outgoing:
        """Queue ``out``; ``wake=False`` leaves waking the thread to a later :meth:`wake` (one
        wake for the messages of a batch to every node, not one per message)."""
        self._outbox.append(out)
        if wake:
            self.wake()
        return out

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx is not None:
                try:
                    os.write(self._wake_tx, b"\0")
                except BlockingIOError:  # the pipe is full of wakes the thread has not read yet
                    pass

    def stop(self, timeout: float = 2.0) -> None:
        self._stop = True
        self.wake()
        self._thread.join(timeout)
        with self._wake_lock:
            os.close(self._wake_tx)
            self._wake_tx = None
        if not self._thread.is_alive():  # a loop still running (a stuck send) still polls its end
            os.close(self._wake_rx)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stop:
                # rounded up: a wait of 0 ms until the tick would spin for up to a millisecond
                wait_ms = 1 if self._in_flight else max(0, int((next_tick - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(wait_ms))
                if self._wake_rx in events:
                    try:
                        while len(os.read(self._wake_rx, 4096)) == 4096:
                            pass
                    except BlockingIOError:
                        pass
                self._flush_outbox()
                if self.sock in events:
                    for _ in range(256):  # then look at the outbox again
                        try:
                            got = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(got)
                self._reap_sent()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self._tick_s
                    self._on_tick(now)
            self._flush_outbox()
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits on this end
            self.error = exc
            for out in list(self._outbox) + self._in_flight:
                out.done()
            if self._on_error is not None:
                self._on_error(exc)

    def _flush_outbox(self) -> None:
        send = self.sock.send
        while self._outbox:
            out = self._outbox.popleft()
            rest = out.rest
            for identity, head in out.heads:
                try:
                    if identity is not None:
                        send(identity, zmq.SNDMORE)
                    if not rest:
                        send(head)
                        continue
                    send(head, zmq.SNDMORE)
                    for frame in rest[:-1]:
                        send(frame, zmq.SNDMORE, copy=False)
                    send(rest[-1], copy=False)
                except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; the heartbeat reports it
                    pass
            if rest:
                out.rest = None  # ZMQ holds its references; the trackers say when it let go
                self._in_flight.append(out)

    def _reap_sent(self) -> None:
        if self._in_flight:
            still = []
            for out in self._in_flight:
                if all(t.done for t in out.trackers):
                    out.sent.set()
                else:
                    still.append(out)
            self._in_flight = still


class Credit:
    """The controller's view of how far a worker is behind (explicit flow control)."""

    def __init__(self):
        self.sent = 0
        self.taken = 0
        self._sizes: collections.deque = collections.deque()
        self._bytes = 0
        self.cond = threading.Condition()

    def acquire(self, nbytes: int, timeout: float, dead) -> bool:
        """Wait (up to ``timeout``) until the worker has room for one more batch; False if not."""
        with self.cond:
            if not self._full(nbytes):  # the common case: no clock, no wait
                self._take(nbytes)
                return True
            deadline = time.monotonic() + timeout
            while self._full(nbytes):
                left = deadline - time.monotonic()
                if left <= 0 or dead():
                    return False
                self.cond.wait(min(left, 0.5))
            self._take(nbytes)
            return True

    def _full(self, nbytes: int) -> bool:
        return (self.sent - self.taken >= WINDOW_BATCHES
                or (self._bytes + nbytes > WINDOW_BYTES and self.sent > self.taken))

    def _take(self, nbytes: int) -> None:
        self.sent += 1
        self._sizes.append(nbytes)
        self._bytes += nbytes

    def taken_upto(self, count: int) -> None:
        with self.cond:
            while self.taken < min(count, self.sent):
                self.taken += 1
                self._bytes -= self._sizes.popleft()
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


def new_context() -> zmq.Context:
    return zmq.Context(io_threads=1)


def quiet_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.SNDHWM, 0)  # no high-water-mark drops: Credit bounds what is queued
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    return s
