"""The remote runner's errors: subclasses of the core's, so ``except WorkerLostError`` and
``except ConfigError`` keep working across runners."""

from __future__ import annotations

from dtorch_core.errors import ConfigError, DTorchError, WorkerLostError


class KeyFileError(ConfigError):
    """The key file is missing, malformed, readable by others, or would be overwritten."""


class AuthenticationError(DTorchError):
    """A peer sent a frame that does not carry a valid HMAC of the session key (no key, another
    key, a replayed or reordered frame). ``peer`` is its address as the socket saw it."""

    def __init__(self, message: str, *, peer: str):
        super().__init__(message)
        self.peer = peer


class WorkersMissingError(WorkerLostError):
    """Not every worker connected to the controller within the start-up timeout."""


class AgentsUnavailableError(ConfigError):
    """``agents=`` was asked for, but the agent client (dtorch_zmq.agent_client) is not there."""
