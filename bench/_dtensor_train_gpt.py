"""PyTorch DTensor anchor for bench/train_gpt.py (run under torchrun, one process per rank).

The GPT of examples/train_gpt.py with the same parallel plan, written with
``torch.distributed.tensor.parallel`` on a 2-D ``(dp, tp)`` DeviceMesh: column-wise q/k/v, MLP fc
and LM head (its logits stay vocabulary-sharded and the loss runs under ``loss_parallel``),
row-wise projections, vocabulary-sharded token embedding; data parallel over "dp" with
``replicate`` from ``torch.distributed._composable.replicate_with_fsdp`` (DTensor parameters
replicated over dp, gradients all-reduced over it in backward). Every dp rank trains on its slice
of the same global batch (and the same data order) as the other sides, with the same AdamW.

Protocol with bench/train_gpt.py: see bench/_torchrun.py. A round of name ``train`` runs
``--steps`` steps between two barriers; rank 0 reports ``{"seconds", "steps", "tokens_per_s"}``.
``final.json`` holds the environment and the loss of every step (the mean over dp).

Without ``--sync-dir`` it runs every round back to back and prints the final JSON:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 \
        --master_addr 127.0.0.1 --master_port 29556 bench/_dtensor_train_gpt.py
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402
from _torchrun import add_anchor_options, environment, report_final, wait_for, write_json  # noqa: E402


def tp_plan():
    """examples/train_gpt.py's ``tp_plan`` in torch's parallel styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def replicate_over(model, dp_mesh):
    """Data parallel with DTensor parameters (the FSDP2-based ``replicate``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    # its mesh keyword was renamed between torch releases
    params = inspect.signature(replicate).parameters
    return replicate(model, **{"mesh" if "mesh" in params else "device_mesh": dp_mesh})


def train_step(model, opt, tokens, targets):
    from torch.distributed.tensor.parallel import loss_parallel

    opt.zero_grad(set_to_none=True)
    with loss_parallel():  # cross entropy on the vocabulary-sharded logits, forward and backward
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
    opt.step()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    _gpt.add_model_options(parser)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    add_anchor_options(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    example = _gpt.load_example()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    model = example.build_model(_gpt.config(args), args.seed)
    parallelize_module(model, mesh["tp"], tp_plan())
    replicate_over(model, mesh["dp"])
    opt = example.make_optimizer(model, args.lr)
    data = example.load_corpus()
    per_rank = args.batch // args.dp
    if per_rank * args.dp != args.batch:
        raise SystemExit(f"--batch {args.batch} must divide by --dp {args.dp} here")
    sync = args.sync_dir if rank == 0 else None
    losses = []  # local (this dp rank's) loss tensors, read after the timing
    step_index = 0

    def run(n):
        nonlocal step_index
        for _ in range(n):
            tokens, targets = example.get_batch(data, step_index, args.batch, args.seq_len, args.seed)
            mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
            losses.append(train_step(model, opt, tokens[mine], targets[mine]).to_local())
            step_index += 1

    run(args.warmup)  # sharding-propagation caches fill here, not in the timing
    dist.barrier()
    if sync:
        write_json(os.path.join(sync, "ready"), {"rank": rank})

    samples = []
    for r in range(args.rounds):
        if sync:
            wait_for(os.path.join(sync, f"go-{r}-train"), args.wait_timeout)
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        run(args.steps)
        dist.barrier()
        seconds = time.perf_counter() - t0
        result = {"seconds": seconds, "steps": args.steps,
                  "tokens_per_s": args.steps * args.batch * args.seq_len / seconds}
        samples.append(result)
        if sync:
            write_json(os.path.join(sync, f"done-{r}-train.json"), result)

    local = torch.stack(losses)
    dist.all_reduce(local, group=dp_group)  # every dp rank's batch slice has the same size
    final = {
        "world_size": dist.get_world_size(),
        "mesh": {"dp": args.dp, "tp": args.tp},
        **environment(),
        "losses": (local / args.dp).tolist(),
        "samples": samples,
    }
    report_final(final, rank, sync)


if __name__ == "__main__":
    main()
