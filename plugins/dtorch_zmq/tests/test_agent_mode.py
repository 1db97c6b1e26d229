"""Agent mode: dt.init(agents=[...]) has `dtorch agent` start the workers (127.0.0.1 only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import torch
from dtorch_zmq.agent_client import agent_info
from dtorch_zmq.keys import read_key

import dtorch_core as dt


def _processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (from /proc)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(name))
            except OSError:
                continue
    return pids


def test_two_agents_start_the_workers_and_shutdown_stops_them(key_file, tmp_path):
    agents, addresses = [], []
    try:
        for i in range(2):
            proc = subprocess.Popen(
                [sys.executable, "-m", "dtorch_core.cli", "agent", "--listen", "127.0.0.1:0", "--key-file", key_file,
                 "--devices", "1", "--log-dir", str(tmp_path / f"agent{i}")],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            agents.append(proc)
        for proc in agents:
            port = re.search(r"listening on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
            addresses.append(f"127.0.0.1:{port}")
        runner = dt.init(world_size=2, runner="remote", agents=addresses, listen="tcp://127.0.0.1:0",
                         key_file=key_file, startup_timeout=60).runner
        controller = runner.address
        mesh = dt.init_device_mesh("cpu", (2,))
        a, b = torch.randn(5, 3), torch.randn(3, 4)
        out = dt.distribute_tensor(a, mesh, [dt.Shard(0)]) @ dt.distribute_tensor(b, mesh, [dt.Replicate()])
        torch.testing.assert_close(out.full_tensor(), a @ b, rtol=1e-4, atol=1e-5)
        assert len(_processes_with(controller)) == 2  # the agents' `dtorch worker --controller ADDR ...`
        dt.shutdown()
        deadline = time.monotonic() + 10
        while _processes_with(controller) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_with(controller) == []
        assert all(agent_info(addr, read_key(key_file))["busy"] is False for addr in addresses)
    finally:
        dt.shutdown()
        for proc in agents:
            proc.terminate()
            proc.wait(10)
