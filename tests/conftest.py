"""Shared fixtures: every test that takes ``runner`` runs once per runner."""

from __future__ import annotations

import os

import pytest
import torch

import dtorch_core as dt

RUNNERS = [r for r in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread").split(",") if r]
WORLD_SIZE = 4


@pytest.fixture(params=RUNNERS)
def runner(request):
    """The runner name; a session of WORLD_SIZE devices is running for the test."""
    dt.init(world_size=WORLD_SIZE, runner=request.param)
    torch.manual_seed(0)
    yield request.param
    dt.shutdown()


@pytest.fixture
def mesh1d(runner):
    return dt.init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("x",))


@pytest.fixture
def mesh2d(runner):
    return dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@pytest.fixture(params=["1d", "2d"])
def mesh(request, runner):
    if request.param == "1d":
        return dt.init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("x",))
    return dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
