"""The interpreter's exit with a session still running (issue 13): a clean exit status, never an
abort from worker threads still inside torch while C++ static destructors run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import torch
    import dtorch_core as dt
    dt.init(world_size=4, runner="thread")
    mesh = dt.init_device_mesh("cpu", (4,))
    x = dt.distribute_tensor(torch.randn(1024, 256), mesh, [dt.Shard(0)])

    @dt.compile
    def f(x):
        y = x @ x.T
        v = y.sum().item()  # a read inside a captured function: CaptureError, uncaught
        for _ in range(30):
            y = (y @ y.T) * 1e-3  # still running on the worker threads when the interpreter exits
        return y

    for _ in range(3):
        f(x)
    """
)


def test_uncaught_capture_error_on_the_thread_runner_exits_with_1_not_sigabrt(tmp_path):
    script = tmp_path / "capture_error.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    for _ in range(2):  # without the fix this aborted (exit -6 / 134) almost every time
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "CaptureError" in proc.stderr
        assert "terminate called" not in proc.stderr
