"""What runs without a GPU: registration through the entry point, the communicator and device
choices, `dtorch info`, and the errors a session on a machine without CUDA gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HAS_GPU

import dtorch_core as dt
from dtorch_core.comm.kinds import choose_communicator
from dtorch_core.plugins import get_plugins
from dtorch_core.worker.streams import WorkerStreams, streams_class

no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the errors of a machine without a GPU")


def test_plugin_registers_cuda_streams_and_its_communicators():
    from dtorch_nccl.inprocess import CudaInProcessExchange
    from dtorch_nccl.plugin import DIST_BACKEND
    from dtorch_nccl.streams import CudaStreams

    plugins = get_plugins()
    assert "nccl" in dict(plugins.describe())
    assert sorted(dict(plugins.describe())["nccl"]) == ["dtorch_register_communicators", "dtorch_register_streams"]
    assert streams_class(plugins.registry("streams"), "cuda") is CudaStreams and issubclass(CudaStreams, WorkerStreams)
    comms = plugins.registry("communicators")
    name, nccl = choose_communicator(comms, "process", "cuda")
    assert name == "nccl" and nccl.dist_backend == DIST_BACKEND == "cpu:gloo,cuda:nccl"
    name, inproc = choose_communicator(comms, "thread", "cuda")
    assert name == "cuda-inprocess" and inproc.create == CudaInProcessExchange.create
    # the CPU choices are untouched by the plugin
    assert choose_communicator(comms, "process", "cpu")[0] == "gloo"
    assert choose_communicator(comms, "thread", "cpu")[0] == "inprocess"


def test_device_for_rank_spreads_ranks_over_the_gpus(monkeypatch):
    from dtorch_nccl.device import device_for_rank
    from dtorch_nccl.streams import CudaStreams

    assert [device_for_rank(r, count=3) for r in range(5)] == [
        torch.device("cuda", i) for i in (0, 1, 2, 0, 1)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert CudaStreams.device_for("cuda", 3) == torch.device("cuda", 1)
    with pytest.raises(dt.errors.DeviceError, match="needs a CUDA device.*sees none"):
        device_for_rank(0, count=0)


def test_dtorch_info_lists_the_plugin():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-m", "dtorch_core.cli", "info", "--json"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert "cuda" in info["streams"] and "cpu" in info["streams"]
    assert {"nccl", "cuda-inprocess", "gloo", "inprocess"} <= set(info["communicators"])
    (plugin,) = [p for p in info["plugins"] if p["name"] == "nccl"]
    assert plugin["source"] == "dtorch-nccl" and plugin["version"] == "0.1.0"


@no_gpu
@pytest.mark.parametrize("runner", ["thread", "process"])
def test_cuda_session_without_a_gpu_says_so(runner):
    with pytest.raises(dt.errors.DeviceError, match="needs a CUDA device"):
        dt.init(world_size=2, runner=runner, device_type="cuda")
    assert not dt.is_initialized()


def test_inline_runner_refuses_cuda():
    with pytest.raises(dt.errors.DeviceError, match="inline runner runs CPU workers only"):
        dt.init(world_size=2, runner="inline", device_type="cuda")
