"""torch.distributed anchor for bench/collectives.py (run under torchrun, one process per rank).

The collectives of bench/_collectives_common.py called directly (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``) on ``cuda:LOCAL_RANK`` through
NCCL (``--device cuda``) or on the CPU through gloo. The control barriers go through a gloo
group, so a rank waiting for the next round keeps no NCCL kernel spinning on a GPU that dtorch
is timing meanwhile.

A round of name ``<op>-<size>`` runs ``--iters`` calls (``--big-iters`` from 256 MiB) back to back, then
``torch.cuda.synchronize()`` and a barrier; rank 0 reports ``{"seconds": total / iters,
"cpu_seconds": CPU time of all ranks / iters}``. Before
its first round each (op, size) gets ``--warmup`` untimed calls. Protocol: bench/_torchrun.py.
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value  # before torch.distributed is imported

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _collectives_common as cc  # noqa: E402
from _torchrun import init_rank, wait_for, write_json  # noqa: E402


def nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=sorted(cc.DTYPES), default="float32")
    p.add_argument("--ops", nargs="+", default=list(cc.OPS))
    p.add_argument("--sizes", nargs="+", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--big-iters", type=int, default=5, help="calls per round for sizes >= 256 MiB")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync-dir", required=True)
    p.add_argument("--wait-timeout", type=float, default=300.0)
    args = p.parse_args()

    import torch.distributed as dist

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, sync = init_rank(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = cc.DTYPES[args.dtype]
    sync_dir = args.sync_dir if rank == 0 else None

    def buffers(op, size):
        rows, cols = cc.shape_for(size, dtype, world)
        full = torch.ones(rows, cols, dtype=dtype, device=device)
        part = torch.ones(rows // world, cols, dtype=dtype, device=device)
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(full, part)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(part, full)
        if op == "all_reduce":
            return lambda: dist.all_reduce(full)
        if op == "all_to_all":
            out = torch.empty_like(part)
            return lambda: dist.all_to_all_single(out, part)
        raise ValueError(op)

    sizes = [cc.parse_size(s) for s in args.sizes]
    sync()
    if sync_dir:
        write_json(os.path.join(sync_dir, "ready"), {"rank": rank})
    for r in range(args.rounds):
        for size in sizes:
            for op in args.ops:
                name = f"{op}-{size}"
                if sync_dir:
                    wait_for(os.path.join(sync_dir, f"go-{r}-{name}"), args.wait_timeout)
                sync()  # nothing of ours runs on the GPUs until the benchmark says go
                call = buffers(op, size)
                for _ in range(args.warmup if r == 0 else 1):
                    call()
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                n = args.big_iters if size >= 256 << 20 else args.iters
                for _ in range(n):
                    call()
                sync()
                seconds = (time.perf_counter() - t0) / n
                # every rank's CPU time (all its threads), summed: the host cost of one call
                cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(cpu)
                call = None
                if sync_dir:
                    write_json(os.path.join(sync_dir, f"done-{r}-{name}.json"),
                               {"seconds": seconds, "cpu_seconds": cpu.item() / n})
    final = {"world_size": world, "backend": str(dist.get_backend()), "torch": torch.__version__,
             "python": platform.python_version(),
             "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu",
             "nccl_version": nccl_version() if cuda else None,
             "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                          "NVSHMEM_DISABLE_NVLS")}}
    if sync_dir:
        write_json(os.path.join(sync_dir, "final.json"), final)
    sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
