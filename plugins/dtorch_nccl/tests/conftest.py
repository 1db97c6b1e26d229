"""Fixtures of the dtorch_nccl tests.

The plugin is used as pip installs it, entry point included: the installed distribution if there
is one, otherwise a copy pip installs into a temporary directory for this run. Tests that need a
GPU carry ``requires_gpu`` and skip, saying why, where torch sees none (CI has none).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# NVLink multicast stays off in this process and every process it starts (workers, benchmarks):
# on shared multi-GPU hosts a program that uses it can take the GPUs down for everyone
for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value

import dtorch_core as dt  # noqa: E402
from dtorch_core.plugins import reset_plugins  # noqa: E402

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(
    not HAS_GPU, reason=f"needs a CUDA GPU; torch {torch.__version__} sees none (CI has none)"
)


def plugin_installed() -> bool:
    return any(ep.name == "nccl" and ep.value == "dtorch_nccl.plugin"
               for ep in importlib.metadata.entry_points(group="dtorch"))


@pytest.fixture(scope="session", autouse=True)
def nccl_plugin(tmp_path_factory):
    """Make the plugin discoverable through its entry point, as an installed plugin is."""
    if not plugin_installed():
        site = tmp_path_factory.mktemp("site")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "--disable-pip-version-check", "--target", str(site), str(PLUGIN_ROOT)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"pip install of {PLUGIN_ROOT} failed:\n{proc.stdout}\n{proc.stderr}"
        sys.path.insert(0, str(site))  # process-runner workers inherit sys.path
        importlib.invalidate_caches()
        assert plugin_installed()
    dt.shutdown()
    reset_plugins()
    yield
    dt.shutdown()
    reset_plugins()


def assert_close(actual, expected, **kwargs):
    if isinstance(actual, dt.DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, **kwargs)
