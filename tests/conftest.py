"""Shared fixtures: every test that takes ``runner`` runs once per runner.

A session per runner is started once (pytest groups the tests by runner, since the fixture
behind ``runner`` is session-scoped) and reset between tests: starting worker processes for each
of thousands of tests would cost minutes. A test that shuts the session down gets a new one.

``DTORCH_TEST_DEVICE`` (default ``cpu``) runs the same tests on another device type, e.g. ``cuda``
with the dtorch_nccl plugin installed; ``DTORCH_TEST_WORLD_SIZE`` (default 4) sets the number of
workers (1 for the process runner on one GPU: NCCL takes one process per GPU). Results are
always compared with plain torch on the CPU.

``remote`` (the dtorch_zmq plugin's runner) is a valid entry of ``DTORCH_TEST_RUNNERS`` but not a
default one (the core suite runs without the plugin): it starts two ``dtorch agent`` processes
on 127.0.0.1 with a key file of the run, for the whole test session, and the workers are theirs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module

from .helpers import DEVICE, MESH_2D, WORLD_SIZE

RUNNERS = [r for r in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process").split(",") if r]


@pytest.fixture(scope="session", params=RUNNERS)
def _runner_name(request, tmp_path_factory):
    agents, saved_env = [], {}
    if request.param == "remote":
        agents = _start_remote_agents(tmp_path_factory.mktemp("remote-agents"))
        # through the environment, so that tests calling dt.init(runner=runner) themselves get them too
        remote_env = {"DTORCH_AGENTS": ",".join(a.address for a in agents), "DTORCH_KEY_FILE": agents[0].key_file,
                      "DTORCH_LISTEN": "tcp://127.0.0.1:0"}
        saved_env = {name: os.environ.get(name) for name in remote_env}
        os.environ.update(remote_env)
    yield request.param
    dt.shutdown()
    for agent in agents:
        agent.stop()
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _LocalAgent:
    """A `dtorch agent` subprocess on 127.0.0.1 (a port it picks) for the ``remote`` runner."""

    def __init__(self, key_file: str, devices: int, log_dir):
        self.key_file = key_file
        # one thread per worker: the machines that run the suite have few cores
        env = dict(os.environ, OMP_NUM_THREADS="1", DTORCH_WORKER_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtorch_core.cli", "agent", "--listen", "127.0.0.1:0", "--key-file", key_file,
             "--devices", str(devices), "--log-dir", str(log_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)  # the agent imports torch before it serves
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", lines[0] if lines else "")
        if match is None:
            self.stop()
            raise RuntimeError(f"dtorch agent did not start (its worker logs: {log_dir}); said {lines!r}")
        self.address = f"127.0.0.1:{match.group(1)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # it stops its session's workers first
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_remote_agents(tmp_dir) -> list:
    try:
        from dtorch_zmq.keys import write_key
    except ImportError:
        pytest.fail("DTORCH_TEST_RUNNERS names 'remote', which needs the dtorch_zmq plugin "
                    "(python -m pip install -e plugins/dtorch_zmq)")
    key_file = str(tmp_dir / "session.key")
    write_key(key_file)
    half = -(-WORLD_SIZE // 2)  # two "nodes": ranks 0..half-1 on the first agent, the rest on the second
    agents: list[_LocalAgent] = []
    try:
        for i in range(2):
            agents.append(_LocalAgent(key_file, half, tmp_dir / f"agent{i}"))
    except BaseException:
        for agent in agents:
            agent.stop()
        raise
    return agents


@pytest.fixture
def runner(_runner_name):
    """The runner name; a session of WORLD_SIZE devices is running for the test."""
    current = session_module._session
    if current is None or current.runner.name != _runner_name or current.world_size != WORLD_SIZE:
        dt.init(world_size=WORLD_SIZE, runner=_runner_name, device_type=DEVICE)
    session = session_module._session
    dt.set_strict(False)  # both switches (rules and gathers); clears the plans, which depend on them
    session.fallback_counts.clear()
    dt.manual_seed(0)
    torch.manual_seed(0)
    yield _runner_name
    if session_module._session is not None:
        dt.set_strict(False)


@pytest.fixture
def mesh1d(runner):
    return dt.init_device_mesh(DEVICE, (WORLD_SIZE,), mesh_dim_names=("x",))


@pytest.fixture
def mesh2d(runner):
    return dt.init_device_mesh(DEVICE, MESH_2D, mesh_dim_names=("dp", "tp"))


@pytest.fixture(params=["1d", "2d"])
def mesh(request, runner):
    if request.param == "1d":
        return dt.init_device_mesh(DEVICE, (WORLD_SIZE,), mesh_dim_names=("x",))
    return dt.init_device_mesh(DEVICE, MESH_2D, mesh_dim_names=("dp", "tp"))
