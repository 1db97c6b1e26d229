"""The core test suite (tests/ of the dtorch checkout) run on CUDA workers.

``tests/conftest.py`` honours ``DTORCH_TEST_DEVICE``, ``DTORCH_TEST_RUNNERS`` and
``DTORCH_TEST_WORLD_SIZE``; this runs it twice: the thread runner with four virtual devices on
one GPU, and the process runner with one worker (NCCL takes one GPU per process). Results are
compared with plain torch on the CPU, so TF32 is off (``NVIDIA_TF32_OVERRIDE=0``). Files that
start sessions of their own on the CPU (channel, wire, CLI, plugin and process-failure tests) are
left out: they would only repeat the CPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_gpu

REPO = Path(__file__).resolve().parents[3]
CORE_TESTS = REPO / "tests"
CPU_ONLY_FILES = ("test_channel.py", "test_wire.py", "test_cli.py", "test_plugins.py", "test_process.py")


def core_suite_command(runner: str, world_size: int, extra=()) -> tuple[list, dict]:
    env = dict(
        os.environ,
        DTORCH_TEST_DEVICE="cuda",
        DTORCH_TEST_RUNNERS=runner,
        DTORCH_TEST_WORLD_SIZE=str(world_size),
        NVIDIA_TF32_OVERRIDE="0",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CORE_TESTS),
           *[f"--ignore={CORE_TESTS / f}" for f in CPU_ONLY_FILES], *extra]
    return cmd, env


@requires_gpu
@pytest.mark.skipif(not (CORE_TESTS / "conftest.py").exists(), reason=f"no dtorch checkout with tests/ at {REPO}")
@pytest.mark.parametrize("runner,world_size", [("thread", 4), ("process", 1)])
def test_core_suite_on_cuda(runner, world_size):
    cmd, env = core_suite_command(runner, world_size)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = proc.stdout[-6000:]
    print(summary)
    assert proc.returncode == 0, f"core suite on cuda ({runner}, world {world_size}) failed:\n{summary}\n{proc.stderr[-3000:]}"
