"""Loopback figures of the remote runner against the process runner, measured in one run.

    python plugins/dtorch_zmq/bench/roundtrip.py [--world 4] [--ops 20000] [--reads 200]

Rows, per runner:
  instructions/s   small ops (x + 1 on a 64x64 shard) issued, then dt.synchronize(): ops / time
                   (each op is one instruction to every worker)
  read round trip  one op then .full_tensor() of a 4-element tensor: time per read
The remote workers are `dtorch worker` subprocesses on 127.0.0.1 (launcher mode).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from dtorch_zmq.keys import write_key

import dtorch_core as dt


def measure(world: int, ops: int, reads: int) -> dict:
    mesh = dt.init_device_mesh("cpu", (world,))
    x = dt.distribute_tensor(torch.zeros(64 * world, 64), mesh, [dt.Shard(0)])
    small = dt.distribute_tensor(torch.zeros(4), mesh, [dt.Replicate()])
    for _ in range(200):  # warm up
        x = x + 1
    dt.synchronize()
    start = time.perf_counter()
    for _ in range(ops):
        x = x + 1
    dt.synchronize()
    issue = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(reads):
        small = small + 1
        small.full_tensor()
    read = time.perf_counter() - start
    assert small.full_tensor()[0].item() == reads
    return {"instructions/s": ops / issue, "read round trip (ms)": 1e3 * read / reads}


def remote(world: int, ops: int, reads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        write_key(key)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        script = os.path.join(os.path.dirname(sys.executable), "dtorch")
        cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "dtorch_core.cli"]
        procs = [subprocess.Popen(cmd + ["worker", "--controller", address, "--key-file", key, "--rank", str(r)])
                 for r in range(world)]
        try:
            dt.init(world_size=world, runner="remote", listen=address, key_file=key)
            return measure(world, ops, reads)
        finally:
            dt.shutdown()
            for p in procs:
                p.wait(15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args()
    rows = {}
    dt.init(world_size=args.world, runner="process")
    try:
        rows["process"] = measure(args.world, args.ops, args.reads)
    finally:
        dt.shutdown()
    rows["remote"] = remote(args.world, args.ops, args.reads)
    print(f"world {args.world}, {args.ops} ops, {args.reads} reads, {os.cpu_count()} CPU cores")
    for name, row in rows.items():
        print(f"  {name:8s} " + "  ".join(f"{k} {v:,.1f}" for k, v in row.items()))
    ratio = rows["remote"]["instructions/s"] / rows["process"]["instructions/s"]
    print(f"  remote/process instructions/s: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
