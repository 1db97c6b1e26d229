"""Shared fixtures: every test that takes ``runner`` runs once per runner.

A session per runner is started once (pytest groups the tests by runner, since the fixture
behind ``runner`` is session-scoped) and reset between tests: starting worker processes for each
of thousands of tests would cost minutes. A test that shuts the session down gets a new one.

``DTORCH_TEST_DEVICE`` (default ``cpu``) runs the same tests on another device type, e.g. ``cuda``
with the dtorch_nccl plugin installed; ``DTORCH_TEST_WORLD_SIZE`` (default 4) sets the number of
workers (1 for the process runner on one GPU: NCCL takes one process per GPU). Results are
always compared with plain torch on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module

from .helpers import DEVICE, MESH_2D, WORLD_SIZE

RUNNERS = [r for r in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process").split(",") if r]


@pytest.fixture(scope="session", params=RUNNERS)
def _runner_name(request):
    yield request.param
    dt.shutdown()


@pytest.fixture
def runner(_runner_name):
    """The runner name; a session of WORLD_SIZE devices is running for the test."""
    current = session_module._session
    if current is None or current.runner.name != _runner_name or current.world_size != WORLD_SIZE:
        dt.init(world_size=WORLD_SIZE, runner=_runner_name, device_type=DEVICE)
    session = session_module._session
    session.strict = False
    session.fallback_counts.clear()
    session.plans.clear()  # plans depend on strict mode
    dt.manual_seed(0)
    torch.manual_seed(0)
    yield _runner_name
    if session_module._session is not None and session_module._session.strict:
        session_module._session.strict = False


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
