"""A loop of one call on a replicated world-1 DTensor (for py-spy --native on the controller)."""
import sys
import time

import torch

import dtorch_core as dt

device, op, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
dt.init(world_size=1, runner="process", device_type=device)
mesh = dt.init_device_mesh(device, (1,))
x = dt.distribute_tensor(torch.randn(1, 64, 32).to(device), mesh, [dt.Replicate()])
f = {"view": lambda: x.view(64, 32), "add": lambda: x + x, "t": lambda: x[0].t()}[op]
t0 = time.time()
while time.time() - t0 < seconds:
    for _ in range(1000):
        f()
    dt.synchronize()
dt.shutdown()
