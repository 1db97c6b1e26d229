"""The interface of the byte-message channels, shared by the backends (pipe.py, shm.py).

What every backend implements (:class:`Channel`), how a child process opens its end
(:class:`ChannelSpec`), the errors and the defaults. The semantics are described in
``channel.py``, which picks a backend and makes and opens channels; the backends import only
this module, so nothing here imports a backend.
"""

from __future__ import annotations

import json
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

Role = Literal["send", "recv"]


class ChannelClosedError(DTorchError, ConnectionError):
    """The other end closed the channel or its process exited, or this end is closed."""


class ChannelTimeoutError(DTorchError, TimeoutError):
    """No message (or no room for one) within the timeout; the channel stays usable."""


class ChannelBackendError(DTorchError):
    """The channel backend asked for (``DTORCH_CHANNEL`` or ``backend=``) is not available."""


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
                return (_rebuild_inherited_spec, (self.role, dup, self.capacity))
        return (ChannelSpec, (self.backend, self.role, self.name, self.fd, self.capacity))


def _rebuild_inherited_spec(role: Role, dup_fd: Any, capacity: int) -> ChannelSpec:
    return ChannelSpec(BACKEND_PIPE, role, fd=dup_fd.detach(), capacity=capacity)
