"""A large tensor through the remote runner on loopback: put (distribute) and read back.

    python plugins/dtorch_zmq/bench/large_tensor.py [--world 2] [--mib 64] [--repeat 5]

Prints MiB/s for distribute_tensor (Shard(0): each worker gets its rows as zero-copy frames) and
for full_tensor (each worker's shard comes back), best of ``--repeat``, and checks the bytes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from dtorch_zmq.keys import write_key

import dtorch_core as dt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        write_key(key)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        script = os.path.join(os.path.dirname(sys.executable), "dtorch")
        cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "dtorch_core.cli"]
        procs = [subprocess.Popen(cmd + ["worker", "--controller", address, "--key-file", key, "--rank", str(r)])
                 for r in range(args.world)]
        try:
            dt.init(world_size=args.world, runner="remote", listen=address, key_file=key)
            mesh = dt.init_device_mesh("cpu", (args.world,))
            big = torch.randn(args.mib * 1024, 256)  # 1 KiB rows
            put, read = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                d = dt.distribute_tensor(big, mesh, [dt.Shard(0)])
                dt.synchronize()
                put.append(time.perf_counter() - start)
                start = time.perf_counter()
                back = d.full_tensor()
                read.append(time.perf_counter() - start)
                assert torch.equal(back, big)
                del d
        finally:
            dt.shutdown()
            for p in procs:
                p.wait(15)
    print(f"{args.mib} MiB over {args.world} workers on loopback ({os.cpu_count()} CPU cores): "
          f"distribute {args.mib / min(put):,.0f} MiB/s, full_tensor {args.mib / min(read):,.0f} MiB/s (best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
