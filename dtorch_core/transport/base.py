"""The interface of the byte-message channels, shared by the backends (pipe.py, shm.py).

What every backend implements (:class:`Channel`), how a child process opens its end
(:class:`ChannelSpec`), the errors and the defaults. The semantics are described in
``channel.py``, which picks a backend and makes and opens channels; the backends import only
this module, so nothing here imports a backend.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import attrs

from ..errors import DTorchError

BACKEND_NATIVE = "native-shm"
BACKEND_PIPE = "pipe"
BACKENDS = (BACKEND_NATIVE, BACKEND_PIPE)

#: Microseconds a blocked native send/receive spins before it sleeps on the futex.
ENV_SPIN_US = "DTORCH_CHANNEL_SPIN_US"
DEFAULT_SPIN_US = 50.0
#: Ring size of a native channel (a power of two); larger messages are streamed through it.
DEFAULT_CAPACITY = 1 << 20
#: The longest message either end accepts (bytes); both backends check it before allocating.
ENV_MAX_MESSAGE = "DTORCH_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE = 64 << 30  # 64 GiB: any real batch or tensor, and no absurd allocation
MAX_MESSAGE_LIMIT = 1 << 47  # what the frame format and the native ring can carry at all

Role = Literal["send", "recv"]


class ChannelError(DTorchError):
    """Base of the channel errors below."""


class ChannelClosedError(ChannelError, ConnectionError):
    """The other end closed the channel or its process exited, or this end is closed."""


class ChannelCorruptError(ChannelClosedError):
    """The other end wrote something impossible (a position or frame length out of bounds, a
    frame over the message limit): this end is closed, since the stream cannot be trusted any
    more. Make a new channel; if the message was real, raise ``DTORCH_MAX_MESSAGE_BYTES``."""


class ChannelMessageTooLargeError(ChannelError, ValueError):
    """``send`` was given a message over the limit (``DTORCH_MAX_MESSAGE_BYTES``); nothing was
    sent and the channel stays usable."""


class ChannelTimeoutError(ChannelError, TimeoutError):
    """No message (or no room for one) within the timeout; the channel stays usable."""


class ChannelBackendError(ChannelError):
    """The channel backend asked for (``DTORCH_CHANNEL`` or ``backend=``) is not available."""


def max_message_bytes(value: int | None = None) -> int:
    """The message size limit: ``value`` when given (> 0), else ``DTORCH_MAX_MESSAGE_BYTES``,
    else 64 GiB; at most 2^47."""
    if value is None or value == 0:
        raw = os.environ.get(ENV_MAX_MESSAGE, "").strip()
        if not raw:
            return DEFAULT_MAX_MESSAGE
        try:
            value = int(raw)
        except ValueError:
            raise ChannelBackendError(
                f"{ENV_MAX_MESSAGE}={raw!r} is not a number of bytes; set it to an integer "
                f"between 1 and 2**47 (default {DEFAULT_MAX_MESSAGE})"
            ) from None
        source = ENV_MAX_MESSAGE
    else:
        source = "max_message"
    if not 0 < value <= MAX_MESSAGE_LIMIT:
        raise ChannelBackendError(
            f"{source}={value} is out of range: the message size limit must be between 1 and "
            f"2**47 bytes (default {DEFAULT_MAX_MESSAGE})"
        )
    return int(value)


def too_large(n: int, limit: int) -> ChannelMessageTooLargeError:
    return ChannelMessageTooLargeError(
        f"a message of {n} bytes is over the limit of {limit} bytes ({ENV_MAX_MESSAGE}, at most "
        f"2^47); nothing was sent. Send it in smaller pieces or raise the limit on both ends"
    )


def frame_too_large(backend: str, n: int, limit: int) -> ChannelCorruptError:
    return ChannelCorruptError(
        f"{backend} channel: a frame claims {n} bytes, over the limit of {limit} bytes "
        f"({ENV_MAX_MESSAGE}, at most 2^47); the stream cannot go on, so this end is closed. "
        f"Raise the limit on both ends if the message is real, else the other process is broken"
    )


# ---------------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------------
class Channel:
    """One end of a one-direction byte-message channel (see the docstring of ``channel.py``)."""

    backend: str = ""
    role: Role

    def send(self, data: Any, timeout: float | None = None) -> None:
        """Send one message; blocks while the channel is full (``timeout`` bounds that wait)."""
        raise NotImplementedError

    def recv(self, timeout: float | None = None) -> bytes:
        """The next message; waits up to ``timeout`` seconds (None: forever) for it to begin."""
        raise NotImplementedError

    def try_recv(self) -> bytes | None:
        """The next message if one has begun to arrive, else None."""
        raise NotImplementedError

    def close(self) -> None:
        """Close this end (idempotent); the other end's waits end with ChannelClosedError."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def child_started(self, pid: int | None = None) -> None:
        """Tell the controller's end that the child process holding the other end started.

        Call it right after starting the child. The pipe backend closes the controller's copy of
        the child's file descriptor here (otherwise the child's death would go unnoticed); the
        native backend starts watching ``pid`` even before the child opens its end.
        """

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.frozen
class ChannelSpec:
    """How a child process opens its end of a channel; pass it to :func:`open_channel`.

    ``role`` is the role of the end opened from this spec. For the pipe backend ``fd`` must be
    inherited by the child: pass :attr:`pass_fds` to ``subprocess.Popen(pass_fds=...)``, or hand
    the spec to a ``multiprocessing`` spawn-context process as an argument (pickling it there
    duplicates the descriptor into the child). :meth:`encode`/:meth:`decode` carry it through a
    command line or an environment variable.
    """

    backend: str
    role: Role
    name: str = ""
    fd: int = -1
    capacity: int = 0
    max_message: int = 0  # 0: the opening process's DTORCH_MAX_MESSAGE_BYTES (or the default)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """File descriptors the child process must inherit."""
        return (self.fd,) if self.fd >= 0 else ()

    def encode(self) -> str:
        return json.dumps(attrs.asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | dict[str, Any]) -> ChannelSpec:
        data = json.loads(text) if isinstance(text, str) else text
        return cls(**data)

    def __reduce__(self):
        if self.backend == BACKEND_PIPE and self.fd >= 0:
            from multiprocessing import context, reduction

            if context.get_spawning_popen() is not None:
                dup = reduction.DupFd(self.fd)
                return (_rebuild_inherited_spec, (self.role, dup, self.capacity, self.max_message))
        return (ChannelSpec, (self.backend, self.role, self.name, self.fd, self.capacity, self.max_message))


def _rebuild_inherited_spec(role: Role, dup_fd: Any, capacity: int, max_message: int = 0) -> ChannelSpec:
    return ChannelSpec(BACKEND_PIPE, role, fd=dup_fd.detach(), capacity=capacity, max_message=max_message)
