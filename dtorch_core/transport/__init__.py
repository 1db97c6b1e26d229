"""Transports between the controller and its workers.

``channel`` is the local (same host) one: one-direction byte-message channels, native shared
memory when the extension is built, an ``os.pipe()`` otherwise.
"""

from __future__ import annotations

from .channel import (
    BACKEND_NATIVE,
    BACKEND_PIPE,
    Channel,
    ChannelBackendError,
    ChannelClosedError,
    ChannelCorruptError,
    ChannelError,
    ChannelMessageTooLargeError,
    ChannelPair,
    ChannelPairSpec,
    ChannelSpec,
    ChannelTimeoutError,
    active_backend,
    channel_pair,
    create_channel,
    local_channel,
    native_available,
    native_unavailable_reason,
    open_channel,
    open_channel_pair,
)

__all__ = [
    "BACKEND_NATIVE",
    "BACKEND_PIPE",
    "Channel",
    "ChannelBackendError",
    "ChannelClosedError",
    "ChannelCorruptError",
    "ChannelError",
    "ChannelMessageTooLargeError",
    "ChannelPair",
    "ChannelPairSpec",
    "ChannelSpec",
    "ChannelTimeoutError",
    "active_backend",
    "channel_pair",
    "create_channel",
    "local_channel",
    "native_available",
    "native_unavailable_reason",
    "open_channel",
    "open_channel_pair",
]
