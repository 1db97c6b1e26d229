"""The controller's heap freeze (dtorch_core/controller/heap.py, ``DTORCH_GC_FREEZE``) on a long
loop of small ops: controller us/op with the freeze on against off, in the same run.

    python bench/gc_heap.py [--ops 100000] [--rounds 3] [--runner thread]

Each round runs the loop once with ``DTORCH_GC_FREEZE=1`` and once with ``0``, each in a fresh
process (world 2, 64x64 shards, ``y = a + a``, OMP_NUM_THREADS=1), and prints their controller
us/op and the garbage collections of each generation during the loop. Unlike
``bench/dispatch.py``, which collects before every round (so that rounds compare), nothing here
collects: the loop meets the full collections a long run meets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LOOP = r"""
import gc, json, os, sys, time
import torch
import dtorch_core as dt
dt.init(world_size=2, runner=sys.argv[2])
mesh = dt.init_device_mesh("cpu", (2,))
a = dt.distribute_tensor(torch.randn(128, 64), mesh, [dt.Shard(0)])
for _ in range(2000):
    y = a + a
dt.synchronize()
n = int(sys.argv[1])
before = [s["collections"] for s in gc.get_stats()]
t0 = time.perf_counter()
for _ in range(n):
    y = a + a
t1 = time.perf_counter()
after = [s["collections"] for s in gc.get_stats()]
dt.synchronize()
print(json.dumps({"us_per_op": (t1 - t0) / n * 1e6, "collections": [b - a for a, b in zip(before, after)],
                  "frozen": gc.get_freeze_count()}))
dt.shutdown()
"""


def run(freeze: str, ops: int, runner: str) -> dict:
    env = dict(os.environ, DTORCH_GC_FREEZE=freeze, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", LOOP, str(ops), runner], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", default="thread")
    args = parser.parse_args()
    results = {"1": [], "0": []}
    for r in range(args.rounds):
        for freeze in ("1", "0"):
            row = run(freeze, args.ops, args.runner)
            results[freeze].append(row)
            print(f"round {r}  freeze {'on ' if freeze == '1' else 'off'}  {row['us_per_op']:6.2f} us/op  "
                  f"collections gen0/1/2 {row['collections']}  frozen objects {row['frozen']:,}")
    on = statistics.median(r["us_per_op"] for r in results["1"])
    off = statistics.median(r["us_per_op"] for r in results["0"])
    print(f"controller us/op, median of {args.rounds}: freeze on {on:.2f}, off {off:.2f}; ratio on/off = {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
