"""Workers do not outlive their controller: SIGKILL it and they exit within 15 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from zmq_testing import LOOPBACK, free_port, reap, start_workers

CONTROLLER = """
import sys, torch, dtorch_core as dt
dt.init(world_size=2, runner="remote", listen=sys.argv[1], key_file=sys.argv[2], startup_timeout=60)
mesh = dt.init_device_mesh("cpu", (2,))
x = dt.distribute_tensor(torch.arange(4.0), mesh, [dt.Shard(0)])
assert x.full_tensor().tolist() == [0.0, 1.0, 2.0, 3.0]
print("up", flush=True)
sys.stdin.read()  # until killed
"""


def test_workers_exit_within_15s_when_the_controller_is_killed(key_file):
    address = f"tcp://{LOOPBACK}:{free_port()}"
    workers = start_workers(address, key_file, [0, 1])
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, address, key_file], stdout=subprocess.PIPE,
                                  stdin=subprocess.PIPE, text=True)
    try:
        assert controller.stdout.readline().strip() == "up"
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(5)
        killed = time.monotonic()
        codes = reap(workers, timeout=15)
        assert time.monotonic() - killed < 15
        assert codes == [3, 3]  # CONTROLLER_GONE
    finally:
        controller.kill()
        for w in workers:
            w.kill()
