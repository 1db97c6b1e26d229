"""The controller's side of the node agent: start workers on an agent and keep their lease.

``start_workers(...)`` returns an :class:`AgentSession` whose background thread renews the lease
every lease/3 seconds. Every failure is a typed dtorch error naming the agent, raised within
``timeout_s`` (a few seconds): unreachable (:class:`AgentUnreachableError`), refusing the key
(:class:`AgentAuthError`), busy with another controller (:class:`AgentBusyError`), or no longer
holding the session (:class:`AgentSessionLostError`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import attrs
import grpc
import structlog

from dtorch_core.errors import ConfigError, DTorchError, WorkerLostError

from . import agent_wire
from .errors import AuthenticationError

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# names the CA certificate (PEM) of agents started with --tls-cert; without it calls are plaintext
TLS_CA_ENV = "DTORCH_AGENT_TLS_CA"


class AgentError(DTorchError):
    """The agent at ``agent`` (HOST:PORT) refused or failed a request."""

    def __init__(self, message: str, *, agent: str):
        super().__init__(message)
        self.agent = agent


class AgentUnreachableError(AgentError, WorkerLostError):
    """The agent did not answer in time, or nothing listens at its address."""


class AgentAuthError(AgentError, AuthenticationError):
    """The agent refused this controller's key (another key file, or none); an
    :class:`AuthenticationError` whose ``peer`` is the agent's address, as for a refused worker."""

    def __init__(self, message: str, *, agent: str):
        DTorchError.__init__(self, message)
        self.agent = self.peer = agent


class AgentBusyError(AgentError):
    """The agent is serving another controller's session."""


class AgentSessionLostError(AgentError, WorkerLostError):
    """The agent no longer holds this session: its lease ran out (the workers were killed), it was
    stopped, or the agent restarted."""


_ERRORS = {
    grpc.StatusCode.UNAVAILABLE: AgentUnreachableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: AgentUnreachableError,
    grpc.StatusCode.PERMISSION_DENIED: AgentAuthError,
    grpc.StatusCode.UNAUTHENTICATED: AgentAuthError,
    grpc.StatusCode.FAILED_PRECONDITION: AgentBusyError,
    grpc.StatusCode.NOT_FOUND: AgentSessionLostError,
}


@attrs.frozen
class WorkerStatus:
    rank: int
    device: int
    pid: int
    alive: bool
    exit_code: int | None
    log: str  # the worker's stdout and stderr, on the agent's node

    @classmethod
    def from_wire(cls, entry: dict) -> WorkerStatus:
        return cls(int(entry["rank"]), int(entry["device"]), int(entry["pid"]), bool(entry["alive"]),
                   entry["exit_code"], str(entry["log"]))


class AgentClient:
    """Authenticated calls to one agent; each either answers within ``timeout_s`` or raises.

    Over TLS when ``tls_ca_file`` (default ``$DTORCH_AGENT_TLS_CA``) names the CA certificate
    that signed the agent's (its name must match the host in ``address``)."""

    def __init__(self, address: str, key: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 tls_ca_file: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._agent_key = agent_wire.derive_agent_key(key)
        tls_ca_file = tls_ca_file or os.environ.get(TLS_CA_ENV) or None
        if tls_ca_file is None:
            self._channel = grpc.insecure_channel(address, options=agent_wire.CHANNEL_OPTIONS)
        else:
            try:
                with open(tls_ca_file, "rb") as f:
                    credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            except OSError as exc:
                raise ConfigError(f"cannot read the agents' TLS CA certificate ({TLS_CA_ENV}): {exc}") from None
            self._channel = grpc.secure_channel(address, credentials, options=agent_wire.CHANNEL_OPTIONS)
        self._calls = {m: self._channel.unary_unary(agent_wire.method_path(m)) for m in agent_wire.METHODS}

    def call(self, method: str, request: dict, *, timeout_s: float | None = None) -> dict:
        body = agent_wire.encode(request)
        token = agent_wire.make_token(self._agent_key, method, body)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = self._calls[method](body, timeout=timeout_s,
                                        metadata=((agent_wire.TOKEN_HEADER, token),))
        except grpc.RpcError as exc:
            raise self._error(method, exc, timeout_s) from None
        except ValueError as exc:  # gRPC's "channel closed": close() came first
            raise AgentError(f"dtorch agent {self.address}: {method} not sent ({exc})", agent=self.address) from None
        return agent_wire.decode(reply)

    def _error(self, method: str, exc: grpc.RpcError, timeout_s: float) -> AgentError:
        code, details = exc.code(), exc.details()
        error = _ERRORS.get(code, AgentError)
        if error is AgentUnreachableError:
            what = f"did not answer {method} within {timeout_s:g} s" if code is grpc.StatusCode.DEADLINE_EXCEEDED \
                else f"is unreachable ({details})"
            message = f"dtorch agent {self.address} {what}; is `dtorch agent` running there?"
        elif error is AgentAuthError:
            message = (f"dtorch agent {self.address} refused the key: {details}; give the controller "
                       "the key file the agent was started with")
        else:
            message = f"dtorch agent {self.address}: {method} failed: {details}"
        return error(message, agent=self.address)

    def close(self) -> None:
        self._channel.close()


class AgentSession:
    """Workers one agent started for this controller; their lease is renewed in the background.

    ``lost`` is the error that ended the renewals (None while the lease holds); ``on_lost`` is
    called with it, from the renewer thread, once.
    """

    def __init__(self, client: AgentClient, started: dict, *,
                 on_lost: Callable[[AgentError], None] | None = None):
        self.client = client
        self.agent = client.address
        self.session_id = str(started["session_id"])
        self.lease_s = float(started["lease_s"])
        self.log_dir = str(started["log_dir"])
        self.workers = tuple(WorkerStatus.from_wire(w) for w in started["workers"])
        self.lost: AgentError | None = None
        self._on_lost = on_lost
        self._renewed_at = time.monotonic()
        self._stopped = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"dtorch-lease-{self.agent}")
        self._renewer.start()

    def renew(self) -> None:
        self.client.call("RenewLease", {"session_id": self.session_id})
        self._renewed_at = time.monotonic()

    def status(self) -> tuple[WorkerStatus, ...]:
        reply = self.client.call("Status", {"session_id": self.session_id})
        return tuple(WorkerStatus.from_wire(w) for w in reply["session"]["workers"])

    def stop(self, grace_s: float = 5.0) -> tuple[WorkerStatus, ...]:
        """Stop the workers (SIGTERM, SIGKILL after ``grace_s``) and end the session; what they
        ended as. A session the agent no longer holds has nothing left to stop: ()."""
        if self._stopped.is_set():
            return ()
        self._stopped.set()
        try:
            # not after the renewer: a renewal in flight to an unreachable agent would add its timeout
            reply = self.client.call("StopWorkers", {"session_id": self.session_id, "grace_s": grace_s},
                                     timeout_s=self.client.timeout_s + grace_s)
        except AgentSessionLostError:
            return ()
        finally:
            self.client.close()  # cancels a renewal still in flight; the renewer then ends quietly
            self._renewer.join(self.client.timeout_s)
        return tuple(WorkerStatus.from_wire(w) for w in reply["workers"])

    def _renew_loop(self) -> None:
        interval = self.lease_s / 3
        while not self._stopped.wait(interval):
            try:
                self.renew()
            except AgentError as exc:
                if self._stopped.is_set():  # stop() ended the session (or cancelled this call)
                    return
                if isinstance(exc, AgentSessionLostError):
                    self._lose(exc)
                    return
                # one missed renewal is not fatal; the lease is lost once the agent would have
                # ended it anyway
                if time.monotonic() - self._renewed_at < self.lease_s:
                    log.warning("agent lease renewal failed; retrying", agent=self.agent, error=str(exc))
                    continue
                self._lose(AgentSessionLostError(
                    f"dtorch agent {self.agent}: lease of session {self.session_id} not renewed for "
                    f"{self.lease_s:g} s, the agent has ended it ({exc})", agent=self.agent))
                return

    def _lose(self, error: AgentError) -> None:
        self.lost = error
        log.error("agent session lost", agent=self.agent, session=self.session_id, error=str(error))
        if self._on_lost is not None:
            self._on_lost(error)


def start_workers(agent_address: str, key: bytes, controller_address: str, ranks, lease_s: float,
                  device_indices=None, *, timeout_s: float = DEFAULT_TIMEOUT_S, tls_ca_file: str | None = None,
                  on_lost: Callable[[AgentError], None] | None = None) -> AgentSession:
    """Ask the agent at ``agent_address`` to start one worker per rank in ``ranks`` (on
    ``device_indices`` of its node, default 0, 1, ...), connecting to ``controller_address``,
    kept alive while the lease of ``lease_s`` seconds is renewed (the returned session does that)."""
    client = AgentClient(agent_address, key, timeout_s=timeout_s, tls_ca_file=tls_ca_file)
    request = {"controller": controller_address, "ranks": [int(r) for r in ranks], "lease_s": float(lease_s),
               "device_indices": None if device_indices is None else [int(d) for d in device_indices]}
    try:
        started = client.call("StartWorkers", request)
    except BaseException:
        client.close()
        raise
    return AgentSession(client, started, on_lost=on_lost)


def agent_info(agent_address: str, key: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               tls_ca_file: str | None = None) -> dict:
    """The agent's description: ``devices``, ``device_type``, ``log_dir``, ``busy``, ``pid``."""
    client = AgentClient(agent_address, key, timeout_s=timeout_s, tls_ca_file=tls_ca_file)
    try:
        return client.call("Status", {})["agent"]
    finally:
        client.close()
