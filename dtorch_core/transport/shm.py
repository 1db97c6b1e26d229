"""The native backend: a shared-memory ring channel from the ``dtorch_core._native`` extension.

Importing this module fails with ImportError when the extension is not built; ``channel.py``
then falls back to the pipe backend. The ring itself (layout, futex waits, large messages) is
described at the top of ``native/shm_channel.cpp``.
"""

from __future__ import annotations

from dtorch_core import _native
from .base import (
    BACKEND_NATIVE,
    DEFAULT_CAPACITY,
    DEFAULT_SPIN_US,
    Channel,
    ChannelClosedError,
    ChannelCorruptError,
    ChannelMessageTooLargeError,
    ChannelTimeoutError,
    Role,
    max_message_bytes,
)

_native.set_error_types(ChannelClosedError, ChannelTimeoutError, ChannelCorruptError,
                        ChannelMessageTooLargeError)


class ShmChannel(Channel):
    """One end of a native shared-memory channel.

    ``send``, ``recv`` and ``try_recv`` are the extension's own methods, bound on the instance,
    so a call costs no Python frame.
    """

    backend = BACKEND_NATIVE

    def __init__(self, ring: _native.ShmChannel):
        self._ring = ring
        self.role: Role = ring.role
        self.name: str = ring.name
        self.capacity: int = ring.capacity
        self.max_message: int = ring.max_message
        self.send = ring.send
        self.recv = ring.recv
        self.try_recv = ring.try_recv
        # the device-drained signal (see runners/process.py: flush on drain)
        self.set_hungry = ring.set_hungry
        self.peer_hungry = ring.peer_hungry
        self.hungry_word = ring.hungry_word

    @classmethod
    def create(
        cls,
        name: str,
        role: Role,
        *,
        capacity: int = DEFAULT_CAPACITY,
        spin_us: float = DEFAULT_SPIN_US,
        max_message: int | None = None,
    ) -> ShmChannel:
        """Create the shared-memory object ``name`` and return its ``role`` end.

        ``max_message``: the longest message this end sends or accepts (default
        ``DTORCH_MAX_MESSAGE_BYTES`` or 64 GiB)."""
        limit = max_message_bytes(max_message)
        return cls(_native.ShmChannel(name, role, True, capacity, spin_us, limit))

    @classmethod
    def open(
        cls, name: str, role: Role, *, spin_us: float = DEFAULT_SPIN_US, max_message: int | None = None
    ) -> ShmChannel:
        """Open the ``role`` end of an existing channel (unlinks its name: both ends hold it)."""
        return cls(_native.ShmChannel(name, role, False, 0, spin_us, max_message_bytes(max_message)))

    def close(self) -> None:
        self._ring.close()

    @property
    def closed(self) -> bool:
        return self._ring.closed

    @property
    def pending(self) -> int:
        """Bytes sent and not yet received (a diagnostic)."""
        return self._ring.pending

    def child_started(self, pid: int | None = None) -> None:
        if pid is not None:
            self._ring.expect_peer(int(pid))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ShmChannel {self.role} {self.name} capacity={self.capacity} {state}>"
