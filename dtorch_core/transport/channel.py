"""Byte-message channels between the controller and a worker process on this host.

A channel is one-directional: one end sends, the other receives, each in its own process. The
controller makes both ends, keeps its own and hands the other end's :class:`ChannelSpec` to the
child process, which opens it with :func:`open_channel`. :func:`channel_pair` makes the usual two
(controller -> worker batches, worker -> controller replies) in one go.

Two backends with the same semantics:

- ``"native-shm"``: the ``dtorch_core._native`` extension, a ring in POSIX shared memory with
  futex wake-ups (no system call on an uncontended send or receive).
- ``"pipe"``: pure Python over ``os.pipe()``, used when the extension is not built.

:func:`active_backend` picks the native one when it imports, else the pipe; the environment
variable ``DTORCH_CHANNEL`` (``native`` or ``pipe``) forces one.

Semantics shared by both backends:

- ``send(data, timeout=None)`` sends one message (``bytes``, ``bytearray``, ``memoryview`` or any
  C-contiguous buffer; 0 bytes is a valid message). It blocks while the channel is full.
- ``recv(timeout=None) -> bytes`` returns the next message; ``None`` waits forever.
  ``try_recv() -> bytes | None`` never waits for a message to begin.
- A timeout bounds the wait for a message (or for room) to *begin*. Once a message has begun to
  move it is finished as fast as the other side goes, so a timeout never splits a message.
  Expiry raises :class:`ChannelTimeoutError` (a ``TimeoutError``).
- ``close()`` on either end makes the other end's waits end: the receiver gets the messages
  already sent, then :class:`ChannelClosedError`; a sender gets :class:`ChannelClosedError` at
  once. A peer process that exits without closing is detected the same way (within ~50-100 ms
  of it blocking for the native backend, at once for the pipe), so nothing waits forever.
- Each end may be used from several threads (operations on one end are serialized).
- Neither end trusts the other: a message longer than the limit (``max_message=``, else
  ``DTORCH_MAX_MESSAGE_BYTES``, default 64 GiB, at most 2^47) is refused by ``send``
  (:class:`ChannelMessageTooLargeError`, nothing sent) and, should a peer send one anyway, by the
  receiver before it allocates; a frame length, or (native) a ring position, that is out of
  bounds closes the receiving or sending end with :class:`ChannelCorruptError` (a
  ChannelClosedError), never a crash.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from typing import Any

import attrs

from . import pipe
# the interface is in base.py (all the backends import); its names stay importable from here
from .base import (  # noqa: F401
    BACKEND_NATIVE,
    BACKEND_PIPE,
    BACKENDS,
    DEFAULT_CAPACITY,
    DEFAULT_MAX_MESSAGE,
    DEFAULT_SPIN_US,
    ENV_MAX_MESSAGE,
    ENV_SPIN_US,
    Channel,
    ChannelBackendError,
    ChannelClosedError,
    ChannelCorruptError,
    ChannelError,
    ChannelMessageTooLargeError,
    ChannelSpec,
    ChannelTimeoutError,
    Role,
    max_message_bytes,
)

ENV_BACKEND = "DTORCH_CHANNEL"

_ENV_ALIASES = {
    "": None,
    "auto": None,
    "native": BACKEND_NATIVE,
    "native-shm": BACKEND_NATIVE,
    "shm": BACKEND_NATIVE,
    "pipe": BACKEND_PIPE,
}


# ---------------------------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------------------------
_native_lock = threading.Lock()
_native_state: tuple[Any, str] | None = None  # (shm module or None, why not)


def _native_backend() -> tuple[Any, str]:
    """(the shm backend module, "") when the extension imports, else (None, the reason)."""
    global _native_state
    if _native_state is None:
        with _native_lock:
            if _native_state is None:
                try:
                    from . import shm
                except ImportError as exc:  # not built, or built for another interpreter
                    _native_state = (None, f"{type(exc).__name__}: {exc}")
                else:
                    _native_state = (shm, "")
    return _native_state


def native_available() -> bool:
    """True when the compiled extension ``dtorch_core._native`` imports."""
    return _native_backend()[0] is not None


def native_unavailable_reason() -> str:
    """Why the native backend is unavailable ("" when it is available)."""
    return _native_backend()[1]


def _requested_backend() -> str | None:
    raw = os.environ.get(ENV_BACKEND, "").strip().lower()
    if raw not in _ENV_ALIASES:
        raise ChannelBackendError(
            f"{ENV_BACKEND}={raw!r} is not a channel backend; use 'native' or 'pipe' "
            "(or leave it unset to pick native when built)"
        )
    return _ENV_ALIASES[raw]


def _resolve(backend: str | None) -> str:
    if backend is None:
        backend = _requested_backend()
    elif backend not in BACKENDS:
        backend = _ENV_ALIASES.get(backend, backend)
        if backend not in BACKENDS:
            raise ChannelBackendError(
                f"unknown channel backend {backend!r}; choose one of {BACKENDS}"
            )
    if backend is None:
        return BACKEND_NATIVE if native_available() else BACKEND_PIPE
    if backend == BACKEND_NATIVE and not native_available():
        raise ChannelBackendError(
            "the native shared-memory channel was requested (DTORCH_CHANNEL or backend=) but the "
            f"extension dtorch_core._native is not available ({native_unavailable_reason()}). "
            "Reinstall dtorch-core where a C++17 compiler and CMake are present "
            "(python -m pip install .), or set DTORCH_CHANNEL=pipe."
        )
    return backend


def active_backend() -> str:
    """The backend new channels use: ``"native-shm"`` or ``"pipe"``.

    ``DTORCH_CHANNEL=native|pipe`` forces one; forcing native without the extension raises
    :class:`ChannelBackendError`.
    """
    return _resolve(None)


def _spin_us() -> float:
    """Spin time before sleeping, from ``DTORCH_CHANNEL_SPIN_US`` (default 50 us)."""
    raw = os.environ.get(ENV_SPIN_US)
    if not raw:
        return DEFAULT_SPIN_US
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ChannelBackendError(
            f"{ENV_SPIN_US}={raw!r} is not a number of microseconds"
        ) from None


# ---------------------------------------------------------------------------------------------
# making and opening channels
# ---------------------------------------------------------------------------------------------
def _shm_name() -> str:
    return f"/dtorch-{os.getpid()}-{secrets.token_hex(8)}"


def create_channel(
    role: Role,
    *,
    backend: str | None = None,
    capacity: int = DEFAULT_CAPACITY,
    spin_us: float | None = None,
    max_message: int | None = None,
) -> tuple[Channel, ChannelSpec]:
    """Make a channel; returns this process's end (``role``) and the spec of the other end.

    Keep the returned end open until the other process has opened its end, and call
    :meth:`Channel.child_started` once that process runs. ``spin_us`` caps how long this end
    spins before sleeping (native backend; default ``DTORCH_CHANNEL_SPIN_US`` or 50 us, 0 never
    spins); the child's end reads ``DTORCH_CHANNEL_SPIN_US`` in the child. ``max_message`` is
    the longest message either end takes (default ``DTORCH_MAX_MESSAGE_BYTES`` or 64 GiB); given
    here, it travels in the spec to the other end too.
    """
    if role not in ("send", "recv"):
        raise ValueError(f"role must be 'send' or 'recv', not {role!r}")
    other: Role = "recv" if role == "send" else "send"
    chosen = _resolve(backend)
    limit = max_message_bytes(max_message)
    given = limit if max_message else 0
    if chosen == BACKEND_NATIVE:
        shm = _native_backend()[0]
        name = _shm_name()
        spin = _spin_us() if spin_us is None else max(0.0, float(spin_us))
        end = shm.ShmChannel.create(name, role, capacity=capacity, spin_us=spin, max_message=limit)
        return end, ChannelSpec(BACKEND_NATIVE, other, name=name, capacity=end.capacity, max_message=given)
    end, child_fd = pipe.PipeChannel.create(role, max_message=limit)
    return end, ChannelSpec(BACKEND_PIPE, other, fd=child_fd, capacity=end.capacity, max_message=given)


def open_channel(spec: ChannelSpec) -> Channel:
    """Open the end described by ``spec`` (in the child process). Takes over ``spec.fd``."""
    if spec.backend == BACKEND_NATIVE:
        shm = _native_backend()[0]
        if shm is None:
            raise ChannelBackendError(
                "this channel was made with the native shared-memory backend, but "
                "dtorch_core._native does not import in this process "
                f"({native_unavailable_reason()})"
            )
        return shm.ShmChannel.open(spec.name, spec.role, spin_us=_spin_us(),
                                   max_message=spec.max_message or None)
    if spec.backend == BACKEND_PIPE:
        return pipe.PipeChannel(spec.fd, spec.role, max_message=spec.max_message or None)
    raise ChannelBackendError(f"unknown channel backend {spec.backend!r} in {spec!r}")


def local_channel(
    *, backend: str | None = None, capacity: int = DEFAULT_CAPACITY, spin_us: float | None = None,
    max_message: int | None = None,
) -> tuple[Channel, Channel]:
    """Both ends of one channel in this process: ``(sender, receiver)`` (tests, threads)."""
    sender, spec = create_channel("send", backend=backend, capacity=capacity, spin_us=spin_us,
                                  max_message=max_message)
    receiver = open_channel(spec)
    detach = getattr(sender, "_disown_child_end", None)
    if detach is not None:
        detach()  # the receiver owns that descriptor now
    return sender, receiver


@attrs.frozen
class ChannelPairSpec:
    """The child's view of a :class:`ChannelPair`: what it receives on and what it sends on."""

    to_child: ChannelSpec
    to_parent: ChannelSpec

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return self.to_child.pass_fds + self.to_parent.pass_fds

    def encode(self) -> str:
        return json.dumps(
            {"to_child": attrs.asdict(self.to_child), "to_parent": attrs.asdict(self.to_parent)},
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str) -> ChannelPairSpec:
        data = json.loads(text)
        return cls(ChannelSpec.decode(data["to_child"]), ChannelSpec.decode(data["to_parent"]))


@attrs.define
class ChannelPair:
    """Two channels, one each way: ``tx`` sends to the other process, ``rx`` receives from it.

    In the controller ``spec`` is what to hand to the child; the child gets its own pair (with
    ``tx``/``rx`` swapped in meaning) from :func:`open_channel_pair`.
    """

    tx: Channel
    rx: Channel
    spec: ChannelPairSpec | None = None

    def child_started(self, pid: int | None = None) -> None:
        self.tx.child_started(pid)
        self.rx.child_started(pid)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()

    def __enter__(self) -> ChannelPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def channel_pair(
    *, backend: str | None = None, capacity: int = DEFAULT_CAPACITY, spin_us: float | None = None
) -> ChannelPair:
    """Make the controller's side of a controller <-> worker pair of channels.

    Start the child with ``pair.spec`` (``pass_fds=pair.spec.pass_fds`` and ``pair.spec.encode()``
    for ``subprocess``; or the spec itself as a ``multiprocessing`` spawn argument), then call
    ``pair.child_started(proc.pid)``. ``spin_us`` as in :func:`create_channel`.
    """
    chosen = _resolve(backend)
    tx, to_child = create_channel("send", backend=chosen, capacity=capacity, spin_us=spin_us)
    try:
        rx, to_parent = create_channel("recv", backend=chosen, capacity=capacity, spin_us=spin_us)
    except BaseException:
        tx.close()
        raise
    return ChannelPair(tx, rx, ChannelPairSpec(to_child, to_parent))


def open_channel_pair(spec: ChannelPairSpec | str) -> ChannelPair:
    """The child's side of :func:`channel_pair`: ``rx`` receives batches, ``tx`` sends replies."""
    if isinstance(spec, str):
        spec = ChannelPairSpec.decode(spec)
    rx = open_channel(spec.to_child)
    try:
        tx = open_channel(spec.to_parent)
    except BaseException:
        rx.close()
        raise
    return ChannelPair(tx, rx, spec)
