"""Helpers of the tests: remote sessions on loopback, workers as `dtorch worker` subprocesses
(127.0.0.1 only: nothing else is ever contacted)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import dtorch_core as dt

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def worker_command(address: str, key_file: str, rank: int) -> list[str]:
    """``dtorch worker ...`` (the console script of this interpreter's environment)."""
    script = os.path.join(os.path.dirname(sys.executable), "dtorch")
    dtorch = [script] if os.path.exists(script) else [sys.executable, "-m", "dtorch_core.cli"]
    return dtorch + ["worker", "--controller", address, "--key-file", key_file, "--rank", str(rank)]


def start_workers(address: str, key_file: str, ranks, env=None) -> list[subprocess.Popen]:
    env = dict(os.environ if env is None else env)
    env.setdefault("DTORCH_WORKER_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return [subprocess.Popen(worker_command(address, key_file, r), env=env, stdin=subprocess.DEVNULL)
            for r in ranks]


def reap(procs, timeout: float = 15.0) -> list:
    """Exit codes of ``procs`` (each waited up to ``timeout`` in all); kills and fails on a survivor."""
    deadline = time.monotonic() + timeout
    codes, alive = [], []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            alive.append(p.pid)
            p.kill()
            p.wait()
            codes.append(None)
    assert not alive, f"workers still running {timeout}s later: {alive}"
    return codes



class RemoteSession:
    def __init__(self, world_size: int, key_file: str, **options):
        self.address = f"tcp://{LOOPBACK}:{free_port()}"
        self.procs = start_workers(self.address, key_file, range(world_size))
        try:
            dt.init(world_size=world_size, runner="remote", listen=self.address, key_file=key_file,
                    startup_timeout=60, **options)
        except BaseException:
            for p in self.procs:
                p.kill()
            raise

    def close(self) -> list:
        dt.shutdown()
        return reap(self.procs)
