"""PyTorch DTensor anchor for bench/dispatch.py (run under torchrun, one process per rank).

Each rank runs its own eager DTensor dispatch of the op streams in ``_streams`` (the same ones
bench/dispatch.py issues through dtorch). Timed rounds are driven by bench/dispatch.py through
files in ``--sync-dir`` so that they interleave with its dtorch and plain-torch rounds: on a busy
machine every side then sees the same background load.

Protocol (rank 0 talks to the parent; other ranks follow through barriers):
  rank 0 writes ``ready`` after warm-up; for each round r and stream s it waits for
  ``go-r-s``, all ranks time ``ops`` ops + a barrier, and rank 0 writes ``done-r-s.json``
  ({"us_per_op": ...}). At the end rank 0 writes ``final.json`` (environment, value check).

Without ``--sync-dir`` it runs every round back to back and prints the final JSON:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        --master_addr 127.0.0.1 --master_port 29555 bench/_dtensor_anchor.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _streams  # noqa: E402  (bench-local helper, shared with dispatch.py)
from _torchrun import environment, report_final, wait_for as _wait_for, write_json as _write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--streams", default=",".join(_streams.STREAMS))
    parser.add_argument("--sync-dir", default=None)
    parser.add_argument("--wait-timeout", type=float, default=120.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    a_full, b_full = _streams.global_inputs(world)
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    streams = args.streams.split(",")
    sync = args.sync_dir if rank == 0 else None

    for name in streams:  # sharding-propagation cache misses happen here, not in the timing
        step, per = _streams.STREAMS[name]
        for _ in range(max(1, args.warmup // per)):
            step(a, b)
    dist.barrier()
    if sync:
        _write_json(os.path.join(sync, "ready"), {"rank": rank})

    samples: dict = {name: [] for name in streams}
    for r in range(args.rounds):
        for name in streams:
            step, per = _streams.STREAMS[name]
            steps = max(1, args.ops // per)
            n_ops = steps * per
            if sync:
                _wait_for(os.path.join(sync, f"go-{r}-{name}"), args.wait_timeout)
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(a, b)
            dist.barrier()
            us = (time.perf_counter() - t0) / n_ops * 1e6
            samples[name].append(us)
            if sync:
                _write_json(os.path.join(sync, f"done-{r}-{name}.json"), {"us_per_op": us, "ops": n_ops})

    # DTensor really computed the stream: compare one result with torch.
    check = _streams.STREAMS["mix"][0](a, b).full_tensor()
    ok = bool(torch.allclose(check, _streams.STREAMS["mix"][0](a_full, b_full)))
    final = {
        "world_size": world,
        **environment(),
        "values_ok": ok,
        "samples_us": samples,
    }
    report_final(final, rank, sync)


if __name__ == "__main__":
    main()
