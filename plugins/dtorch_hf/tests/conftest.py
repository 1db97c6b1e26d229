"""Fixtures of the dtorch_hf tests: a 4-device session per runner (module-scoped, so each
runner's processes start once per test module), tiny random T5 models saved and loaded back
through ``save_pretrained``/``from_pretrained`` (nothing is downloaded), and meshes."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import dtorch_core as dt

RUNNERS = [r for r in os.environ.get("DTORCH_HF_TEST_RUNNERS", "thread,process").split(",") if r]
WORLD_SIZE = 4


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request):
    """A session of four workers on ``request.param``, for the whole module."""
    dt.init(world_size=WORLD_SIZE, runner=request.param)
    yield request.param
    dt.shutdown()


@pytest.fixture
def session(runner):
    """The module's session, reset: fallbacks counted from zero, seeds fixed."""
    dt.set_strict(False)
    from dtorch_core.controller import session as session_module

    session_module._session.fallback_counts.clear()
    dt.manual_seed(0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # dtorch's one-time "no sharding rule" warnings; the tests compare values instead
        warnings.simplefilter("ignore")
        yield runner
