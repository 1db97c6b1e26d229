"""Imported by every Python process that has this folder on its path: only a dtorch process
runner worker (started with ``--config-fd``) with ``DTORCH_GPU_IDLE_OUT`` set installs the
profiling window of ``gpu_idle_trace`` (bench/gpu_idle.py puts the folder on the path)."""

import os
import sys

if os.environ.get("DTORCH_GPU_IDLE_OUT") and "--config-fd" in sys.argv:
    import gpu_idle_trace

    gpu_idle_trace.install()
