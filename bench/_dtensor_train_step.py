"""PyTorch DTensor anchor for bench/train_step.py (run under torchrun, one process per rank).

examples/train_gpt.py's GPT with tensor parallelism only, on a 1-D ``tp`` DeviceMesh of all the
ranks: the plan of bench/_dtensor_train_gpt.py (``torch.distributed.tensor.parallel``: column-wise
q/k/v, MLP fc and LM head with vocabulary-sharded logits under ``loss_parallel``, row-wise
projections, vocabulary-sharded token embedding), ``torch.optim.AdamW`` with the example's
hyper-parameters, and the same batches in the same order as the other sides.

Each step is timed on its own: rank 0's wall time for one step plus a barrier (every rank has
finished it), the counterpart of bench/train_step.py's step plus ``dt.synchronize()``.

Protocol with bench/train_step.py: see bench/_torchrun.py. A round of name ``train`` runs
``--steps`` steps; rank 0 reports ``{"step_seconds": [...]}``. ``final.json`` holds the
environment and the loss of every step (warm-up included).

Without ``--sync-dir`` it runs every round back to back and prints the final JSON:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \
        --master_addr 127.0.0.1 --master_port 29557 bench/_dtensor_train_step.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402
from _dtensor_train_gpt import tp_plan, train_step  # noqa: E402  (the same torch plan and step)
from _torchrun import add_anchor_options, environment, report_final, wait_for, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    _gpt.add_model_options(parser)
    add_anchor_options(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    example = _gpt.load_example()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = example.build_model(_gpt.config(args), args.seed)
    parallelize_module(model, mesh, tp_plan())
    opt = example.make_optimizer(model, args.lr)
    data = example.load_corpus()
    batches = [example.get_batch(data, i, args.batch, args.seq_len, args.seed)
               for i in range(args.warmup + args.rounds * args.steps)]
    sync = args.sync_dir if rank == 0 else None
    losses = []  # loss DTensors (replicated), read after the timing

    for i in range(args.warmup):  # sharding-propagation caches fill here, not in the timing
        losses.append(train_step(model, opt, *batches[i]))
    dist.barrier()
    if sync:
        write_json(os.path.join(sync, "ready"), {"rank": rank})

    samples = []
    for r in range(args.rounds):
        if sync:
            wait_for(os.path.join(sync, f"go-{r}-train"), args.wait_timeout)
        gc.collect()
        dist.barrier()
        seconds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, *batches[len(losses)]))
            dist.barrier()
            seconds.append(time.perf_counter() - t0)
        samples.append(seconds)
        if sync:
            write_json(os.path.join(sync, f"done-{r}-train.json"), {"step_seconds": seconds})

    final = {
        "world_size": dist.get_world_size(),
        **environment(),
        "losses": [v.full_tensor().item() for v in losses],
        "samples": samples,
    }
    report_final(final, rank, sync)


if __name__ == "__main__":
    main()
