"""The node agent (`dtorch agent`) and its client, on 127.0.0.1 only.

Tests start the agent as a subprocess through the `dtorch` CLI on a port it picks (port 0), with
stand-in workers that only print their arguments and sleep (they get what `dtorch worker` would);
the key file is conftest's. dt.init(agents=...) with real workers is test_agent_mode.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from dtorch_zmq import agent_wire
from dtorch_zmq.agent_client import (
    AgentAuthError,
    AgentBusyError,
    AgentClient,
    AgentError,
    AgentSessionLostError,
    AgentUnreachableError,
    agent_info,
    start_workers,
)
from dtorch_zmq.agent_service import (
    WorkerProcess,
    default_worker_command,
    stop_processes,
)
from dtorch_zmq.keys import read_key
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netns import alive

# prints its arguments (to its log), then sleeps; rank 99 fails at once with exit code 3
STAND_IN_SCRIPT = (
    "import sys, time; rank = int(sys.argv[sys.argv.index('--rank') + 1]); "
    "print('stand-in worker', *sys.argv[1:], flush=True); "
    "sys.exit(3) if rank == 99 else time.sleep(60)"
)
STAND_IN_WORKER = f'{sys.executable} -c "{STAND_IN_SCRIPT}"'
FAILING_RANK = 99
CONTROLLER = "tcp://127.0.0.1:1"  # never contacted: the stand-in workers only sleep
GRACE_S = 1.0


class Agent:
    """A `dtorch agent` subprocess; its structlog output goes to ``log_path``."""

    def __init__(self, tmp_path, key_file: str, devices: int = 4, listen: str = "127.0.0.1:0",
                 extra: tuple[str, ...] = ("--worker-command", STAND_IN_WORKER)):
        self.log_path = tmp_path / f"agent-{time.monotonic_ns()}.log"
        self.worker_logs = tmp_path / "worker-logs"
        env = dict(os.environ, DTORCH_LOG_LEVEL="info", NO_COLOR="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dtorch_core.cli", "agent", "--listen", listen, *extra,
                 "--key-file", key_file, "--devices", str(devices), "--log-dir", str(self.worker_logs),
                 "--grace", str(GRACE_S)],
                stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        line = _read_line(self.proc.stdout, timeout_s=60)
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"no ready line from the agent: {line!r}\n{self.log()}"
        self.address = f"127.0.0.1:{match.group(1)}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _read_line(stream, timeout_s: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else ""


def _wait_until(condition, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def spawned_pids():
    """Worker pids a test saw; any still alive at the end are killed (and fail the test)."""
    pids: list[int] = []
    yield pids
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.killpg(pid, signal.SIGKILL)
    assert not left, f"worker processes left behind: {left}"


@pytest.fixture(scope="module")
def shared_agent(tmp_path_factory, key_file):
    """One agent for the tests that end their sessions (starting one takes seconds)."""
    running = Agent(tmp_path_factory.mktemp("agent"), key_file)
    yield running
    running.stop()


@pytest.fixture
def agent(shared_agent, key_file):
    yield shared_agent
    assert shared_agent.proc.poll() is None, shared_agent.log()
    assert agent_info(shared_agent.address, read_key(key_file))["busy"] is False


@pytest.fixture
def own_agent(tmp_path, key_file):
    """An agent of the test's own, for tests that kill or stop it."""
    running = Agent(tmp_path, key_file)
    yield running
    running.stop()


def test_health_serving_and_info(agent, key_file):
    with grpc.insecure_channel(agent.address, options=agent_wire.CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", agent_wire.SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = agent_info(agent.address, read_key(key_file))
    assert info["devices"] == 4 and info["device_type"] == "cpu" and not info["busy"]
    assert info["log_dir"] == str(agent.worker_logs) and info["pid"] == agent.proc.pid


def test_start_status_stop_leaves_no_process(agent, key_file, spawned_pids):
    session = start_workers(agent.address, read_key(key_file), CONTROLLER, ranks=[3, 5], lease_s=10,
                            device_indices=[2, 0])
    spawned_pids.extend(w.pid for w in session.workers)
    workers = session.status()
    assert [(w.rank, w.device, w.alive, w.exit_code) for w in workers] == [(3, 2, True, None), (5, 0, True, None)]
    for w in workers:
        assert alive(w.pid)
        with open(f"/proc/{w.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[-9:-1] == [b"--controller", CONTROLLER.encode(), b"--key-file", key_file.encode(),
                               b"--rank", str(w.rank).encode(), b"--device-index", str(w.device).encode()]
        assert os.path.dirname(w.log) == session.log_dir and os.path.isfile(w.log)
    assert session.log_dir.startswith(str(agent.worker_logs))
    stopped = session.stop(grace_s=GRACE_S)
    assert [w.rank for w in stopped] == [3, 5] and not any(w.alive for w in stopped)
    assert [w.exit_code for w in stopped] == [-signal.SIGTERM, -signal.SIGTERM]
    assert not any(alive(w.pid) for w in workers)
    assert agent_info(agent.address, read_key(key_file))["busy"] is False
    assert "agent stopped a session" in agent.log()


def test_status_reports_a_failed_worker_and_logs_per_rank(agent, key_file, spawned_pids):
    session = start_workers(agent.address, read_key(key_file), CONTROLLER, ranks=[0, FAILING_RANK], lease_s=10)
    spawned_pids.extend(w.pid for w in session.workers)
    _wait_until(lambda: not session.status()[1].alive, timeout_s=10)
    healthy, failed = session.status()
    assert (healthy.rank, healthy.alive, healthy.exit_code) == (0, True, None)
    assert (failed.rank, failed.alive, failed.exit_code) == (FAILING_RANK, False, 3)
    for w in (healthy, failed):
        log = pathlib.Path(w.log)
        _wait_until(lambda log=log: "stand-in worker" in log.read_text(), timeout_s=10)
        assert f"--rank {w.rank} --device-index {w.device}" in log.read_text()
    stopped = session.stop(grace_s=GRACE_S)
    assert [w.exit_code for w in stopped] == [-signal.SIGTERM, 3]


def test_stop_escalates_to_sigkill_for_the_whole_process_group(tmp_path):
    # a worker that ignores SIGTERM and has a child of its own
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(child.pid, flush=True); time.sleep(60)")
    popen = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    child_pid = int(_read_line(popen.stdout, timeout_s=30))
    worker = WorkerProcess(rank=0, device=0, log_path=str(tmp_path / "unused.log"), popen=popen)
    start = time.monotonic()
    stop_processes([worker], grace_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5
    assert popen.returncode == -signal.SIGKILL
    _wait_until(lambda: not alive(child_pid), timeout_s=5)


def test_wrong_key_is_refused_and_logged(agent, key_file):
    other_key = os.urandom(32)
    logged_before = len(agent.log())
    start = time.monotonic()
    with pytest.raises(AgentAuthError, match=re.escape(agent.address)) as caught:
        start_workers(agent.address, other_key, CONTROLLER, ranks=[0], lease_s=10)
    assert time.monotonic() - start < 5
    assert caught.value.agent == agent.address
    # no token at all: the same refusal, from a plain gRPC call
    with grpc.insecure_channel(agent.address, options=agent_wire.CHANNEL_OPTIONS) as channel:
        status = channel.unary_unary(agent_wire.method_path("Status"))
        with pytest.raises(grpc.RpcError) as raw:
            status(agent_wire.encode({}), timeout=5)
    assert raw.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _wait_until(lambda: agent.log()[logged_before:].count("agent refused a call") >= 2, timeout_s=5)
    refusals = [line for line in agent.log()[logged_before:].splitlines() if "agent refused a call" in line]
    assert "token not made with this agent's key" in refusals[0] and "no token" in refusals[1]
    assert all("peer=ipv4:127.0.0.1:" in line for line in refusals)
    assert agent_info(agent.address, read_key(key_file))["busy"] is False


def test_token_is_bound_to_method_body_and_used_once():
    agent_key = agent_wire.derive_agent_key(os.urandom(32))
    checker = agent_wire.TokenChecker(agent_key)
    body = agent_wire.encode({"session_id": "abc"})
    token = agent_wire.make_token(agent_key, "RenewLease", body)
    assert checker.refusal(token, "StopWorkers", body) == "token not made with this agent's key"
    assert checker.refusal(token, "RenewLease", agent_wire.encode({"session_id": "abd"})) is not None
    assert checker.refusal(token, "RenewLease", body) is None
    assert checker.refusal(token, "RenewLease", body) == "token replayed"
    stale = agent_wire.make_token(agent_key, "RenewLease", body, now=time.time() - 600)
    assert checker.refusal(stale, "RenewLease", body).startswith("token +600 s old")
    assert checker.refusal(None, "RenewLease", body) == "no token"


def test_renewed_lease_holds_and_a_busy_agent_refuses(agent, key_file, spawned_pids):
    key = read_key(key_file)
    session = start_workers(agent.address, key, CONTROLLER, ranks=[0, 1], lease_s=1.2)
    spawned_pids.extend(w.pid for w in session.workers)
    time.sleep(3.0)  # 2.5 leases: only the background renewals keep the workers
    assert session.lost is None and all(w.alive for w in session.status())
    with pytest.raises(AgentBusyError, match=session.session_id):
        start_workers(agent.address, key, CONTROLLER, ranks=[2], lease_s=5, device_indices=[3])
    with pytest.raises(AgentError, match="device indices must be distinct"):
        AgentClient(agent.address, key).call("StartWorkers", {"controller": CONTROLLER, "ranks": [0],
                                                              "lease_s": 5, "device_indices": [4]})
    session.stop(grace_s=GRACE_S)


def test_lease_expiry_kills_workers_and_a_new_session_follows(agent, key_file, spawned_pids):
    key = read_key(key_file)
    lease_s = 1.5
    # a controller that starts workers and then never renews (no AgentSession, no renewer)
    client = AgentClient(agent.address, key)
    started = client.call("StartWorkers", {"controller": CONTROLLER, "ranks": [0, 1], "lease_s": lease_s})
    pids = [w["pid"] for w in started["workers"]]
    spawned_pids.extend(pids)
    took = _wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=lease_s + GRACE_S + 3)
    assert took >= lease_s - 0.2
    assert "agent lease expired" in agent.log()
    with pytest.raises(AgentSessionLostError, match="lease .* ran out"):
        client.call("RenewLease", {"session_id": started["session_id"]})
    client.close()
    second = start_workers(agent.address, key, CONTROLLER, ranks=[0, 1], lease_s=10)
    spawned_pids.extend(w.pid for w in second.workers)
    assert second.session_id != started["session_id"] and all(w.alive for w in second.status())
    second.stop(grace_s=GRACE_S)


def test_killed_agent_gives_typed_errors_within_seconds_and_a_restarted_one_serves(
        own_agent, tmp_path, key_file, spawned_pids):
    agent = own_agent
    key = read_key(key_file)
    lost = []
    session = start_workers(agent.address, key, CONTROLLER, ranks=[0], lease_s=1.5, on_lost=lost.append)
    spawned_pids.extend(w.pid for w in session.workers)
    agent.proc.kill()
    agent.proc.wait()
    # the agent could not stop its workers: the kernel does (their parent-death signal)
    _wait_until(lambda: not any(alive(w.pid) for w in session.workers), timeout_s=3)
    start = time.monotonic()
    with pytest.raises(AgentUnreachableError, match=re.escape(agent.address)):
        session.status()
    assert time.monotonic() - start < 5
    _wait_until(lambda: bool(lost), timeout_s=1.5 + 6)
    assert isinstance(lost[0], AgentSessionLostError) and session.lost is lost[0]
    assert agent.address in str(lost[0])
    with pytest.raises(AgentUnreachableError):
        start_workers(agent.address, key, CONTROLLER, ranks=[0], lease_s=5)
    restarted = Agent(tmp_path, key_file, listen=agent.address)
    try:
        # a new client: the old one's channel is in its reconnect back-off (up to 2 s)
        with pytest.raises(AgentSessionLostError, match="did the agent restart"):
            AgentClient(restarted.address, key).call("Status", {"session_id": session.session_id})
        second = start_workers(restarted.address, key, CONTROLLER, ranks=[0], lease_s=5)
        spawned_pids.extend(w.pid for w in second.workers)
        assert all(w.alive for w in second.status())
        second.stop(grace_s=GRACE_S)
    finally:
        restarted.stop()


def test_agent_sigterm_stops_its_workers(own_agent, key_file, spawned_pids):
    agent = own_agent
    session = start_workers(agent.address, read_key(key_file), CONTROLLER, ranks=[0, 1], lease_s=30)
    spawned_pids.extend(w.pid for w in session.workers)
    agent.proc.terminate()
    assert agent.proc.wait(timeout=GRACE_S + 10) == 0
    assert not any(alive(w.pid) for w in session.workers)
    assert "agent shutting down" in agent.log()


def test_unreachable_agent_is_named_within_seconds(key_file):
    address = "127.0.0.1:9"  # discard port: nothing listens there on this machine
    start = time.monotonic()
    with pytest.raises(AgentUnreachableError, match=re.escape(address)):
        start_workers(address, read_key(key_file), CONTROLLER, ranks=[0], lease_s=5, timeout_s=2)
    assert time.monotonic() - start < 4


def test_agent_help_through_the_cli():
    result = subprocess.run([sys.executable, "-m", "dtorch_core.cli", "agent", "--help"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--listen", "--key-file", "--devices", "--worker-command"):
        assert option in result.stdout


def test_default_worker_command_is_dtorch_worker():
    assert default_worker_command() == [sys.executable, "-m", "dtorch_core.cli", "worker"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_agent(tmp_path, key_file, spawned_pids):
    cert, private_key = tmp_path / "agent.crt", tmp_path / "agent.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(private_key), "-out", str(cert)], check=True, capture_output=True)
    agent = Agent(tmp_path, key_file, extra=("--tls-cert", str(cert), "--tls-key", str(private_key),
                                             "--worker-command", STAND_IN_WORKER))
    try:
        key = read_key(key_file)
        session = start_workers(agent.address, key, CONTROLLER, ranks=[0], lease_s=10, tls_ca_file=str(cert))
        spawned_pids.extend(w.pid for w in session.workers)
        assert [w.alive for w in session.status()] == [True]
        assert not any(w.alive for w in session.stop(grace_s=GRACE_S))
        start = time.monotonic()
        with pytest.raises(AgentUnreachableError, match=re.escape(agent.address)):
            agent_info(agent.address, key, timeout_s=3)  # plaintext to a TLS agent
        assert time.monotonic() - start < 4
    finally:
        agent.stop()

