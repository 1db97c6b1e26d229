"""The pure-Python fallback channel: length-prefixed frames over an ``os.pipe()``.

A frame is an 8-byte little-endian length and the payload. Both descriptors are non-blocking and
waits go through ``poll`` (in 50 ms slices, so a ``close()`` from another thread of this process
ends them too); the kernel reports the other side's exit as end-of-file (receiver) or EPIPE
(sender), which become :class:`ChannelClosedError`. The pipe is enlarged to 1 MiB where the
system allows it (``/proc/sys/fs/pipe-max-size``) so batches rarely block.

The writer is not trusted: a frame length over the message limit (``DTORCH_MAX_MESSAGE_BYTES``,
default 64 GiB) closes this end with :class:`ChannelCorruptError` before anything is allocated,
and a large frame's buffer grows only as its bytes arrive (a lying length allocates nothing it
is not sent). ``send`` refuses a message over the limit with ChannelMessageTooLargeError.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import threading
import time
from typing import Any

from .base import (
    BACKEND_PIPE,
    Channel,
    ChannelClosedError,
    ChannelTimeoutError,
    Role,
    frame_too_large,
    max_message_bytes,
    too_large,
)

_HEADER = struct.Struct("<Q")
_HEADER_SIZE = _HEADER.size
# Frames up to this size are joined with their header and written in one call.
_JOIN_LIMIT = 64 * 1024
# Bytes asked of each read (stays below glibc's mmap threshold, so reads allocate cheaply).
_READ_CHUNK = 64 * 1024
# A large frame is read into pieces of this size, each allocated when its bytes are due.
_LARGE_PIECE = 16 << 20
_PIPE_SIZE = 1 << 20
_SLICE_MS = 50
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


def _grow_pipe(fd: int) -> int:
    """Enlarge the pipe's kernel buffer as far as allowed; returns its size."""
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = _PIPE_SIZE
    for size in (min(_PIPE_SIZE, limit), 256 * 1024):
        try:
            return fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
        except OSError:
            continue
    try:
        return fcntl.fcntl(fd, _F_GETPIPE_SZ)
    except OSError:
        return 64 * 1024


class PipeChannel(Channel):
    """One end of a pipe channel (see the module docstring)."""

    backend = BACKEND_PIPE

    @classmethod
    def create(cls, role: Role, *, max_message: int | None = None) -> tuple[PipeChannel, int]:
        """A new pipe: this process's ``role`` end and the descriptor of the other end."""
        read_fd, write_fd = os.pipe()
        size = _grow_pipe(write_fd)
        if role == "send":
            return cls(write_fd, "send", child_fd=read_fd, capacity=size, max_message=max_message), read_fd
        return cls(read_fd, "recv", child_fd=write_fd, capacity=size, max_message=max_message), write_fd

    def __init__(self, fd: int, role: Role, *, child_fd: int = -1, capacity: int = 0,
                 max_message: int | None = None):
        if role not in ("send", "recv"):
            raise ValueError(f"role must be 'send' or 'recv', not {role!r}")
        if fd < 0:
            raise ValueError("a pipe channel needs an open file descriptor")
        self.role: Role = role
        self.capacity = capacity
        self.max_message = max_message_bytes(max_message)
        self._fd = fd
        self._child_fd = child_fd  # the other end's descriptor, until the child has it
        self._closing = False
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._pos = 0
        os.set_blocking(fd, False)
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN if role == "recv" else select.POLLOUT)
        if not capacity:
            try:
                self.capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
            except OSError:
                self.capacity = 64 * 1024

    # -----------------------------------------------------------------------------------------
    # sending
    # -----------------------------------------------------------------------------------------
    def send(self, data: Any, timeout: float | None = None) -> None:
        if self.role != "send":
            raise ValueError("this end of the pipe channel receives; it cannot send")
        view = memoryview(data)
        if not view.c_contiguous:
            raise BufferError("channel messages must be C-contiguous buffers")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if n > self.max_message:
            raise too_large(n, self.max_message)
        with self._lock:
            fd = self._fd
            if fd < 0 or self._closing:
                raise ChannelClosedError("pipe channel: this end is closed")
            if n <= _JOIN_LIMIT:
                frame = b"".join((_HEADER.pack(n), view))
                try:
                    written = os.write(fd, frame)
                except BlockingIOError:
                    written = 0
                except (BrokenPipeError, ConnectionResetError):
                    raise self._reader_gone() from None
                if written == len(frame):
                    return
                parts: list[Any] = [memoryview(frame)[written:]]
                self._write_rest(parts, timeout if written == 0 else None)
            else:
                self._write_rest([_HEADER.pack(n), view], timeout)

    def _write_rest(self, parts: list[Any], timeout: float | None) -> None:
        # The timeout covers the wait for room to begin; after the first byte the frame is
        # committed (a torn frame would corrupt the stream).
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        fd = self._fd
        while parts:
            try:
                written = os.writev(fd, parts)
            except BlockingIOError:
                if not self._wait(deadline):
                    raise ChannelTimeoutError(
                        f"pipe channel: no room for a message within {timeout} s"
                    ) from None
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise self._reader_gone() from None
            deadline = None
            while written:
                size = len(parts[0])
                if written >= size:
                    written -= size
                    parts.pop(0)
                else:
                    parts[0] = memoryview(parts[0])[written:]
                    written = 0

    def _reader_gone(self) -> ChannelClosedError:
        return ChannelClosedError(
            "pipe channel: the reader is gone (its process exited or it called close())"
        )

    # -----------------------------------------------------------------------------------------
    # receiving
    # -----------------------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> bytes:
        if self.role != "recv":
            raise ValueError("this end of the pipe channel sends; it cannot receive")
        with self._lock:
            message = self._take()
            if message is not None:
                return message
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
            if not self._read_some(deadline):
                raise ChannelTimeoutError(f"pipe channel: no message within {timeout} s")
            return self._finish()

    def try_recv(self) -> bytes | None:
        if self.role != "recv":
            raise ValueError("this end of the pipe channel sends; it cannot receive")
        with self._lock:
            message = self._take()
            if message is not None:
                return message
            self._check_open()
            if len(self._buf) == self._pos and not self._read_some(time.monotonic()):
                return None
            return self._finish()

    def _check_open(self) -> None:
        if self._fd < 0 or self._closing:
            raise ChannelClosedError("pipe channel: this end is closed")

    def _take(self) -> bytes | None:
        """A complete buffered message, or None."""
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < _HEADER_SIZE:
            return None
        (n,) = _HEADER.unpack_from(buf, pos)
        if n > self.max_message:
            raise self._corrupt(n)
        end = pos + _HEADER_SIZE + n
        if end > len(buf):
            return None
        with memoryview(buf) as view:
            message = view[pos + _HEADER_SIZE : end].tobytes()
        if end == len(buf):
            buf.clear()
            self._pos = 0
        else:
            self._pos = end
        return message

    def _finish(self) -> bytes:
        """Something of a message is buffered: wait (no timeout: it is under way) for the rest."""
        while True:
            message = self._take()
            if message is not None:
                return message
            buffered = len(self._buf) - self._pos
            if buffered >= _HEADER_SIZE:
                (n,) = _HEADER.unpack_from(self._buf, self._pos)
                if n > _READ_CHUNK:
                    return self._read_large(n)
            self._read_some(None)

    def _corrupt(self, n: int) -> ChannelClosedError:
        """A frame over the limit: close this end (the lock is held) and say why."""
        self._closing = True
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        self._buf.clear()
        self._pos = 0
        return frame_too_large("pipe", n, self.max_message)

    def _read_large(self, n: int) -> bytes:
        """Read a big frame whose header is buffered, in pieces allocated as its bytes arrive."""
        start = self._pos + _HEADER_SIZE
        pieces = [bytes(memoryview(self._buf)[start:])]
        have = len(pieces[0])
        self._buf.clear()
        self._pos = 0
        while have < n:
            piece = bytearray(min(_LARGE_PIECE, n - have))
            filled = 0
            with memoryview(piece) as view:
                while filled < len(piece):
                    try:
                        got = os.readv(self._fd, [view[filled:]])
                    except BlockingIOError:
                        self._wait(None)
                        continue
                    if got == 0:
                        raise ChannelClosedError(
                            "pipe channel: the writer closed the pipe in the middle of a message "
                            "(its process exited or it called close())"
                        )
                    filled += got
            pieces.append(piece)
            have += filled
        return b"".join(pieces)

    def _read_some(self, deadline: float | None) -> bool:
        """Append at least one byte to the buffer; False if the deadline passed first."""
        while True:
            try:
                chunk = os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                if not self._wait(deadline):
                    return False
                continue
            if not chunk:
                partial = len(self._buf) > self._pos
                raise ChannelClosedError(
                    "pipe channel: the writer closed the pipe"
                    + (" in the middle of a message" if partial else "; no more messages")
                    + " (its process exited or it called close())"
                )
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += chunk
            return True

    # -----------------------------------------------------------------------------------------
    # waiting and lifecycle
    # -----------------------------------------------------------------------------------------
    def _wait(self, deadline: float | None) -> bool:
        """Poll until the descriptor is ready (or hung up); False once ``deadline`` passed."""
        while True:
            if self._closing:
                raise ChannelClosedError("pipe channel: this end was closed while waiting")
            slice_ms = _SLICE_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                slice_ms = min(slice_ms, max(1, int(remaining * 1000) + 1))
            if self._poller.poll(slice_ms):
                return True

    def close(self) -> None:
        self._closing = True
        with self._lock:  # a wait in another thread sees _closing within one slice
            fd, self._fd = self._fd, -1
            child, self._child_fd = self._child_fd, -1
        for d in (fd, child):
            if d >= 0:
                try:
                    os.close(d)
                except OSError:
                    pass

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def child_started(self, pid: int | None = None) -> None:
        child, self._child_fd = self._child_fd, -1
        if child >= 0:
            os.close(child)

    def _disown_child_end(self) -> None:
        self._child_fd = -1

    def fileno(self) -> int:
        """The pipe descriptor (for ``select``/``poll`` across several channels)."""
        return self._fd

    def __del__(self) -> None:
        for d in (getattr(self, "_fd", -1), getattr(self, "_child_fd", -1)):
            if d >= 0:
                try:
                    os.close(d)
                except OSError:
                    pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<PipeChannel {self.role} {state} capacity={self.capacity}>"
