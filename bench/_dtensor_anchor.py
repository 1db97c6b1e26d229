"""PyTorch DTensor anchor for bench/dispatch.py (run under torchrun, one process per rank).

Each rank runs its own eager DTensor dispatch of the same op streams that bench/dispatch.py
issues through dtorch; rank 0 writes the per-op times to ``--out`` as JSON. Not meant to be run
by hand (bench/dispatch.py launches it on 127.0.0.1 only), but it works on its own:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        --master_addr 127.0.0.1 --master_port 29555 bench/_dtensor_anchor.py --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _streams  # noqa: E402  (bench-local helper, shared with dispatch.py)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--streams", default=",".join(_streams.STREAMS))
    parser.add_argument("--out", required=True)
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

    results = {}
    for name in args.streams.split(","):
        step, ops_per_step = _streams.STREAMS[name]
        steps = max(1, args.ops // ops_per_step)
        n_ops = steps * ops_per_step
        for _ in range(max(1, args.warmup // ops_per_step)):  # sharding-prop cache misses happen here
            step(a, b)
        dist.barrier()
        samples = []
        for _ in range(args.repeats):
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(a, b)
            dist.barrier()
            samples.append((time.perf_counter() - t0) / n_ops * 1e6)
        results[name] = {"us_per_op": statistics.median(samples), "samples_us": samples, "ops": n_ops}

    # Sanity check that DTensor really computed the stream (values are compared on rank 0).
    check = _streams.STREAMS["add"][0](a, b).full_tensor()
    ok = bool(torch.allclose(check, a_full + a_full))

    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "world_size": world,
                    "backend": dist.get_backend(),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "num_threads": torch.get_num_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "values_ok": ok,
                    "streams": results,
                },
                f,
                indent=2,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
