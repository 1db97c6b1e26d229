"""Bounded sending to one worker of the process runner.

A channel's ``send`` blocks while the worker's ring is full, and a timeout only bounds the wait
for a message to *begin* (transport/channel.py): a worker that stops (SIGSTOP, a hang) in the
middle of a large message would block the sender for ever. So the session's flush never calls
``send`` on a channel that may block: each worker has a :class:`Sender` whose thread does the
blocking sends, in order, and the runner's watchdog asks :meth:`Sender.stuck_for` how long the
current send has waited, declaring the worker lost past the timeout.

Small messages are still sent from the caller's thread when nothing is queued, with a zero
timeout (a message that fits the ring, or an atomic pipe write, moves whole or not at all), so
the common case costs no thread hand-off.
"""

from __future__ import annotations

import collections
import select
import threading
import time

from ..transport.base import ChannelTimeoutError

PIPE_ATOMIC = getattr(select, "PIPE_BUF", 512) - 16  # frame header included
MAX_QUEUED_BYTES = 256 << 20  # the controller waits (up to the timeout) beyond this backlog


def direct_limit(channel) -> int:
    """The largest message ``channel.send(data, 0)`` moves whole or not at all."""
    if getattr(channel, "backend", "") == "native-shm":
        return max(0, int(getattr(channel, "capacity", 0)) // 2)
    return PIPE_ATOMIC


class SendStalled(Exception):
    """The backlog for a worker stayed over the limit for the whole timeout."""


class Sender:
    """Sends messages to one channel in order, from its own thread when they may block."""

    def __init__(self, rank: int, channel, on_error):
        self.rank = rank
        self.channel = channel
        self._on_error = on_error  # on_error(rank, exc): the channel broke
        self._limit = direct_limit(channel)
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._busy_since: float | None = None  # when the send in progress began
        self._stopped = False
        self.failed = False
        self._thread = threading.Thread(target=self._loop, name=f"dtorch-send-{rank}", daemon=True)
        self._thread.start()

    def send(self, data, timeout: float) -> None:
        """Queue ``data`` (or send it at once when that cannot block); waits up to ``timeout``
        while the backlog is over :data:`MAX_QUEUED_BYTES`, then raises :class:`SendStalled`."""
        n = len(data)
        with self._cond:
            if self.failed or self._stopped:
                return  # the runner already knows; it raises at its own checks
            if not self._queue and self._busy_since is None and n <= self._limit:
                try:
                    self.channel.send(data, 0.0)
                    return
                except ChannelTimeoutError:
                    pass  # no room now: the thread waits for it
                except Exception as exc:  # noqa: BLE001 - the channel broke: the worker is lost
                    self.failed = True
                    self._on_error(self.rank, exc)
                    return
            if self._queued_bytes > MAX_QUEUED_BYTES:
                deadline = time.monotonic() + timeout
                while self._queued_bytes > MAX_QUEUED_BYTES and not (self.failed or self._stopped):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SendStalled(f"no batch left for {timeout:g}s")
                    self._cond.wait(left)
            self._queue.append(data)
            self._queued_bytes += n
            self._cond.notify_all()

    def stuck_for(self) -> float:
        """Seconds the oldest unsent message has waited (0 when nothing waits)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def stop(self, timeout: float) -> bool:
        """Send what is queued and end the thread (within ``timeout``); True when it ended."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return
                data = self._queue[0]
                if self._busy_since is None:
                    self._busy_since = time.monotonic()
            try:
                self.channel.send(data)
            except Exception as exc:  # noqa: BLE001 - the channel broke: the worker is lost
                with self._cond:
                    self.failed = True
                    self._queue.clear()
                    self._queued_bytes = 0
                    self._busy_since = None
                    self._cond.notify_all()
                self._on_error(self.rank, exc)
                return
            with self._cond:
                self._queue.popleft()
                self._queued_bytes -= len(data)
                self._busy_since = time.monotonic() if self._queue else None
                self._cond.notify_all()
