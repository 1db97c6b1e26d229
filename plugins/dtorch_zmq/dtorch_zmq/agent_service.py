"""The node agent's gRPC service: start, watch and stop one session's worker processes.

One session at a time: StartWorkers opens it (a session id, one subprocess per rank), RenewLease
keeps it, StopWorkers ends it, and a controller that stops renewing loses it: when its lease runs
out the agent kills the workers (SIGTERM, then SIGKILL after a grace) and is free for the next
session. Each worker runs in its own process group, so whatever it starts dies with it, and on
Linux the kernel kills the workers of an agent that dies without stopping them.
Workers' stdout and stderr go to ``<log dir>/session-<id>/rank-<R>.log``.

Calls without a valid token (``agent_wire``) are refused with PERMISSION_DENIED and logged with
the caller's address. The standard gRPC health service answers without a token.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures

import attrs
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import agent_wire

log = structlog.get_logger(__name__)

MAX_LEASE_S = 3600.0
DEFAULT_GRACE_S = 5.0
# how often the lease watchdog looks; a lease ends at most this late
WATCH_INTERVAL_S = 0.1


# exec'd in front of every worker on Linux: the kernel SIGKILLs the worker when the agent dies,
# even by SIGKILL, when nothing of the agent's can stop it. PR_SET_PDEATHSIG fires when the
# thread that forked exits: gRPC's handler threads (which fork) live as long as the server.
_DIE_WITH_AGENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(70)  # the agent died before the prctl\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def default_worker_command() -> list[str]:
    """``dtorch worker`` as this interpreter runs it (no reliance on PATH)."""
    return [sys.executable, "-m", "dtorch_core.cli", "worker"]


class Refusal(Exception):
    """A call the agent answers with a gRPC error status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@attrs.define
class WorkerProcess:
    rank: int
    device: int
    log_path: str
    popen: subprocess.Popen

    def describe(self) -> dict:
        code = self.popen.poll()
        return {"rank": self.rank, "device": self.device, "pid": self.popen.pid,
                "alive": code is None, "exit_code": code, "log": self.log_path}


@attrs.define
class Session:
    id: str
    peer: str
    controller: str
    lease_s: float
    deadline: float  # time.monotonic() when the lease runs out
    log_dir: str
    workers: list[WorkerProcess]

    def describe(self) -> dict:
        return {"session_id": self.id, "controller": self.controller, "lease_s": self.lease_s,
                "lease_left_s": max(0.0, self.deadline - time.monotonic()), "log_dir": self.log_dir,
                "workers": [w.describe() for w in self.workers]}


def stop_processes(workers: list[WorkerProcess], grace_s: float) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``grace_s``; reap all."""
    for w in workers:
        _signal_group(w.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        # the group too: a worker that exited may have left children behind
        _signal_group(w.popen, signal.SIGKILL)
        w.popen.wait()


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)  # start_new_session=True: the group id is the worker's pid
    except (ProcessLookupError, PermissionError):
        pass


class AgentService:
    """The agent's state and its RPC handlers."""

    def __init__(self, *, key: bytes, key_file: str, devices: int, device_type: str, log_dir: str,
                 worker_command: list[str] | None = None, grace_s: float = DEFAULT_GRACE_S):
        self.key_file = os.path.abspath(key_file)
        self.devices = devices
        self.device_type = device_type
        self.log_dir = os.path.abspath(log_dir)
        self.worker_command = list(worker_command or default_worker_command())
        self.grace_s = grace_s
        self._tokens = agent_wire.TokenChecker(agent_wire.derive_agent_key(key))
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._ended: dict[str, str] = {}  # session id -> how it ended, for later calls naming it
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_lease, name="dtorch-agent-lease", daemon=True)
        self._watchdog.start()

    # -- gRPC plumbing ---------------------------------------------------------------------------
    def generic_handler(self) -> grpc.GenericRpcHandler:
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(self._handler(name, getattr(self, _snake(name))))
            for name in agent_wire.METHODS
        }
        return grpc.method_handlers_generic_handler(agent_wire.SERVICE, handlers)

    def _handler(self, method: str, fn):
        def handle(body: bytes, context: grpc.ServicerContext) -> bytes:
            token = dict(context.invocation_metadata()).get(agent_wire.TOKEN_HEADER)
            refusal = self._tokens.refusal(token, method, body)
            if refusal is not None:
                log.warning("agent refused a call", peer=context.peer(), method=method, reason=refusal)
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"refused: {refusal} (controller and agent must share one key file)")
            try:
                request = agent_wire.decode(body)
                return agent_wire.encode(fn(request, context.peer()))
            except Refusal as exc:
                context.abort(exc.code, str(exc))
            except (ValueError, KeyError, TypeError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {method} request: {exc!r}")

        return handle

    # -- RPCs ------------------------------------------------------------------------------------
    def start_workers(self, request: dict, peer: str) -> dict:
        controller = str(request["controller"])
        ranks = [int(r) for r in request["ranks"]]
        lease_s = float(request["lease_s"])
        devices = request.get("device_indices")
        devices = list(range(len(ranks))) if devices is None else [int(d) for d in devices]
        self._check_start(ranks, devices, lease_s)
        with self._lock:
            if self._session is not None:
                current = self._session
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"busy with session {current.id} of controller {current.controller} "
                              f"(its lease runs out within {current.deadline - time.monotonic():.1f} s)")
            session_id = uuid.uuid4().hex[:12]
            log_dir = os.path.join(self.log_dir, f"session-{session_id}")
            os.makedirs(log_dir, exist_ok=True)
            workers: list[WorkerProcess] = []
            try:
                for rank, device in zip(ranks, devices):
                    workers.append(self._spawn(controller, rank, device, log_dir))
            except OSError as exc:
                stop_processes(workers, 0.0)
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"cannot start {self.worker_command[0]!r}: {exc}") from None
            self._session = Session(session_id, peer, controller, lease_s,
                                    time.monotonic() + lease_s, log_dir, workers)
            described = self._session.describe()
        log.info("agent started a session", session=session_id, peer=peer, controller=controller,
                 ranks=ranks, devices=devices, lease_s=lease_s, log_dir=log_dir)
        return described

    def renew_lease(self, request: dict, peer: str) -> dict:
        with self._lock:
            session = self._current(str(request["session_id"]))
            session.deadline = time.monotonic() + session.lease_s
            return {"session_id": session.id, "lease_left_s": session.lease_s}

    def stop_workers(self, request: dict, peer: str) -> dict:
        grace_s = min(float(request.get("grace_s", self.grace_s)), 60.0)
        with self._lock:
            session = self._current(str(request["session_id"]))
            self._end(session, "stopped by its controller")
        stop_processes(session.workers, grace_s)
        log.info("agent stopped a session", session=session.id, peer=peer)
        return session.describe()

    def status(self, request: dict, peer: str) -> dict:
        with self._lock:
            session_id = request.get("session_id")
            if session_id is not None:
                session = self._current(str(session_id)).describe()
            else:
                session = None if self._session is None else self._session.describe()
            return {"agent": self.describe(), "session": session}

    def describe(self) -> dict:
        return {"pid": os.getpid(), "devices": self.devices, "device_type": self.device_type,
                "log_dir": self.log_dir, "busy": self._session is not None}

    # -- sessions --------------------------------------------------------------------------------
    def _check_start(self, ranks: list[int], devices: list[int], lease_s: float) -> None:
        def refuse(message: str):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)

        if not ranks:
            refuse("no ranks to start")
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            refuse(f"ranks must be distinct and >= 0, got {ranks}")
        if len(devices) != len(ranks):
            refuse(f"{len(ranks)} ranks but {len(devices)} device indices")
        if len(set(devices)) != len(devices) or not all(0 <= d < self.devices for d in devices):
            refuse(f"device indices must be distinct, in 0..{self.devices - 1} "
                   f"(this agent offers {self.devices}), got {devices}")
        if not 0 < lease_s <= MAX_LEASE_S:
            refuse(f"lease_s must be in (0, {MAX_LEASE_S:.0f}], got {lease_s}")

    def _spawn(self, controller: str, rank: int, device: int, log_dir: str) -> WorkerProcess:
        command = [*self.worker_command, "--controller", controller, "--key-file", self.key_file,
                   "--rank", str(rank), "--device-index", str(device)]
        if sys.platform.startswith("linux"):
            command = [sys.executable, "-c", _DIE_WITH_AGENT, str(os.getpid()), *command]
        log_path = os.path.join(log_dir, f"rank-{rank}.log")
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return WorkerProcess(rank, device, log_path, popen)

    def _current(self, session_id: str) -> Session:
        session = self._session
        if session is None or session.id != session_id:
            ended = self._ended.get(session_id)
            reason = f"it was {ended}" if ended else "this agent never started it (did the agent restart?)"
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"no session {session_id}: {reason}")
        return session

    def _end(self, session: Session, how: str) -> None:
        """Forget ``session`` (the caller holds the lock and stops its workers after)."""
        self._session = None
        self._ended[session.id] = how
        while len(self._ended) > 64:
            self._ended.pop(next(iter(self._ended)))

    def _watch_lease(self) -> None:
        """End the session when its lease runs out (killing its workers), or when every worker has
        exited (a controller that died or was cut off: its workers leave within seconds, and the
        agent is free for the next session without waiting out the lease)."""
        while not self._closing.wait(WATCH_INTERVAL_S):
            with self._lock:
                session = self._session
                if session is None:
                    continue
                codes = [w.popen.poll() for w in session.workers]
                if None not in codes:
                    self._end(session, f"ended by the agent: all its workers exited (exit codes {codes})")
                    log.info("agent session ended: all its workers exited", session=session.id,
                                controller=session.controller, exit_codes=codes)
                elif time.monotonic() >= session.deadline:
                    self._end(session, f"ended by the agent: its lease ({session.lease_s:g} s) ran out")
                    log.warning("agent lease expired: killing the session's workers", session=session.id,
                                controller=session.controller, lease_s=session.lease_s,
                                pids=[w.popen.pid for w in session.workers])
                else:
                    continue
            try:  # (for exited workers: what they left in their process groups)
                stop_processes(session.workers, self.grace_s)
            except Exception:  # the watchdog must outlive one failed stop
                log.exception("agent could not stop an expired session's workers", session=session.id)

    def close(self) -> None:
        """Stop the watchdog and the current session's workers (the agent is going away)."""
        self._closing.set()
        with self._lock:
            session = self._session
            if session is not None:
                self._end(session, "ended by the agent shutting down")
        if session is not None:
            log.warning("agent shutting down: stopping the session's workers", session=session.id)
            stop_processes(session.workers, self.grace_s)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def serve(listen: str, service: AgentService, *, tls: tuple[bytes, bytes] | None = None,
          threads: int = 8) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start a gRPC server on ``listen`` (HOST:PORT; port 0 picks one) with ``service`` and the
    health service, over TLS when ``tls`` is (private key PEM, certificate chain PEM); returns
    the server, the bound port and the health servicer."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dtorch-agent"))
    server.add_generic_rpc_handlers((service.generic_handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, grpc.ssl_server_credentials([tls]))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    for name in ("", agent_wire.SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
