"""PyTorch DTensor anchor for bench/tp_scaling.py (run under torchrun, one process per rank).

bench/_tp_block.py's block with ``torch.distributed.tensor.parallel``: column-wise q/k/v/fc,
row-wise attention and MLP projections on a 1-D ``tp`` DeviceMesh of all the ranks. On cuda the
process group is ``cuda:nccl,cpu:gloo`` (rank r on ``cuda:r``): the collectives of the block go
through NCCL, and the control barriers through gloo on the CPU, so a rank waiting for the
benchmark's next round keeps no NCCL kernel spinning on a GPU that dtorch is timing meanwhile.

Each step is timed on its own: rank 0's wall time for one step, then ``torch.cuda.synchronize()``
and a barrier (every rank has finished it), the counterpart of a dtorch step plus
``dt.synchronize()``.

Protocol with bench/tp_scaling.py: see bench/_torchrun.py. A round of name ``step`` runs
``--steps`` steps; rank 0 reports ``{"step_seconds": [...]}``; ``final.json`` holds the
environment and the check values (mean square of the output, sum of squares of mlp.fc's weight
gradient) of one more step.

Without ``--sync-dir`` it runs every round back to back and prints the final JSON:

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29557 \
        bench/_dtensor_tp_block.py --device cpu --d-model 256 --seq-len 64 --batch 2 --dtype float32
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value  # before torch.distributed is imported

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tp_block  # noqa: E402
from _torchrun import add_anchor_options, init_rank, wait_for, write_json  # noqa: E402


def check_values(block, y) -> dict:
    grad = block.mlp.fc.weight.grad
    grad_sq = grad.float().pow(2).sum()
    if hasattr(grad_sq, "full_tensor"):
        grad_sq = grad_sq.full_tensor()
    return {"y_mean_square": y.float().pow(2).mean().item(), "fc_grad_sum_square": grad_sq.item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    _tp_block.add_block_options(parser)
    add_anchor_options(parser)
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, sync = init_rank(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()

    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("tp",))
    if _tp_block.init_mode(args) == "cpu":
        block = _tp_block.build_block(args).to(device)
    else:
        block = _tp_block.build_block(args, device)
        torch.manual_seed(args.seed + rank)
    plan = {**{n: ColwiseParallel() for n in _tp_block.PLAN_COL}, **{n: RowwiseParallel() for n in _tp_block.PLAN_ROW}}
    parallelize_module(block, mesh, plan)
    x, g = (t.to(device) for t in _tp_block.inputs(args))
    sync_dir = args.sync_dir if rank == 0 else None

    for _ in range(args.warmup):
        _tp_block.fwd_bwd(block, x, g)
    sync()
    if sync_dir:
        write_json(os.path.join(sync_dir, "ready"), {"rank": rank})

    samples = []
    for r in range(args.rounds):
        if sync_dir:
            wait_for(os.path.join(sync_dir, f"go-{r}-step"), args.wait_timeout)
        gc.collect()
        sync()
        seconds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            _tp_block.fwd_bwd(block, x, g)
            sync()
            seconds.append(time.perf_counter() - t0)
        samples.append(seconds)
        if sync_dir:
            write_json(os.path.join(sync_dir, f"done-{r}-step.json"), {"step_seconds": seconds})

    block.zero_grad(set_to_none=True)
    y = block(x)
    y.backward(g)
    checks = check_values(block, y)
    final = {
        "world_size": world,
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu",
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")},
        "checks": checks,
        "samples": samples,
    }
    if rank == 0:
        if sync_dir:
            write_json(os.path.join(sync_dir, "final.json"), final)
        else:
            print(json.dumps(final, indent=2))
    sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
