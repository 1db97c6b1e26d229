"""Training steps of standard transformer blocks: plain torch against dtorch eager and replay.

    python bench/model_steps.py [--device cuda] [--dtype bf16] [--sizes small,large]
                                [--families llama,gpt2,t5,dit] [--runner process] [--world-size 1]
                                [--steps 10] [--profile] [--top 8] [--json out.json]

The blocks are bench/_blocks.py's (Llama, GPT-2, T5, DiT/Flux-style), each at a small
(overhead-bound) and a large (compute-bound) size. A step is forward, backward,
``torch.optim.AdamW(foreach=True).step()`` and ``zero_grad()``, on the same weights and batches
on every side (``--optim dtorch``: the dtorch sides use ``dt.optim.AdamW``):
  torch    the plain model on one device
  eager    the model on a dtorch mesh (every parameter replicated; with ``--world-size`` > 1 the
           batch is sharded over the mesh, data parallel), the step called directly
  replay   the same step under ``dt.compile`` (one RunProgram per step after the capture)
Each step ends with a device synchronisation (``dt.synchronize()`` on the dtorch sides); the
median step time is reported with its ratio to torch's from the same run, and the losses of the
sides are checked against each other.

``--profile`` counts the CUDA kernels of one step on each side with torch.profiler, and their
summed GPU time. The dtorch workers must run in this process for the profiler to see their
kernels: profile with ``--runner thread``. ``--top N`` prints the kernels whose launch counts
differ between torch and each dtorch side.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, os.path.dirname(BENCH_DIR))  # run from a checkout without installing dtorch-core

import _blocks  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def set_flush_policy(batch_size=None, interval=None, first_batch=None, growth=None) -> None:
    """The process runner's batching (its FlushPolicy), to measure a choice; None keeps a value."""
    import attrs

    from dtorch_core.runners.process import ProcessRunner

    changes = {k: v for k, v in dict(batch_size=batch_size, interval=interval, first_batch=first_batch,
                                     growth=growth).items()
               if v is not None}
    ProcessRunner.flush_policy = attrs.evolve(ProcessRunner.flush_policy, **changes)


def add_flush_options(parser) -> None:
    parser.add_argument("--flush-batch", type=int, default=None, help="process runner: instructions per batch")
    parser.add_argument("--flush-first", type=int, default=None, help="process runner: first batch after a sync")
    parser.add_argument("--flush-interval", type=float, default=None, help="process runner: flush timer (s)")
    parser.add_argument("--flush-growth", type=int, default=None, help="process runner: batch growth after a sync")


def train_step(model, opt, loss_fn, batch):
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def make_optimizer(model, kind="torch"):
    if kind == "dtorch":
        import dtorch_core as dt

        return dt.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "fused":  # both sides: torch's fused kernel (dtorch: one worker call per group)
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


class Side:
    """One copy of the model with its optimizer and a way to run and time a step."""

    def __init__(self, name, model, batches, loss_fn, sync, *, step=train_step, optim="torch"):
        self.name = name
        self.model = model
        self.opt = make_optimizer(model, optim)
        self.batches = batches
        self.loss_fn = loss_fn
        self.sync = sync
        self.step_fn = step
        self.losses: list = []
        self.issued: list = []

    def step(self) -> float:
        batch = self.batches[len(self.losses) % len(self.batches)]
        t0 = time.perf_counter()
        loss = self.step_fn(self.model, self.opt, self.loss_fn, batch)
        self.issued.append(time.perf_counter() - t0)  # dtorch: the controller's own time
        self.sync()
        self.losses.append(loss)
        return time.perf_counter() - t0

    def loss_values(self) -> list[float]:
        out = []
        for v in self.losses:
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out.append(float(v.float().item()))
        return out


def profile_step(side):
    """(kernel launches, summed kernel time in ms, Counter of kernel names) for one step."""
    from torch.profiler import ProfilerActivity, profile

    side.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        side.step()
        side.sync()
    names = collections.Counter()
    total_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
            total_us += e.device_time
    return sum(names.values()), total_us / 1000, names


def run_case(dt, args, family, size, mesh, dtype, device):
    torch.manual_seed(args.seed)
    model, batch_fn, loss_fn = _blocks.make(family, size, dtype=dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [batch_fn(i) for i in range(args.steps + args.warmup + 4)]
    sides = []

    torch_model = model.to(device)
    torch_batches = [tuple(t.to(device) for t in b) for b in batches]
    sync_torch = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sides.append(Side("torch", torch_model, torch_batches, loss_fn, sync_torch,
                      optim="fused" if args.optim == "fused" else "torch"))

    # the batches are on the devices before the steps on every side (torch's on its GPU, dtorch's
    # distributed), so the steps time the model and not the host-to-device copy of the data
    batch_placements = [dt.Shard(0)] if args.world_size > 1 else [dt.Replicate()]
    dtorch_batches = [tuple(dt.distribute_tensor(t, mesh, batch_placements) for t in b) for b in batches]

    for name in ("eager", "replay"):
        fresh, _, _ = _blocks.make(family, size, dtype=dtype)
        fresh.load_state_dict(state, strict=False)
        dmodel = dt.nn.parallelize_module(fresh, mesh, {})
        step = dt.compile(train_step) if name == "replay" else train_step
        sides.append(Side(name, dmodel, dtorch_batches, loss_fn, dt.synchronize, step=step, optim=args.optim))

    rows = {}
    for side in sides:
        try:
            for _ in range(args.warmup):
                side.step()
            gc.collect()
            times = [side.step() for _ in range(args.steps)]
            row = {"ms": 1000 * statistics.median(times),
                   "issue_ms": 1000 * statistics.median(side.issued[-args.steps:])}
            if args.profile and device == "cuda":
                row["kernels"], row["cuda_ms"], row["names"] = profile_step(side)
            rows[side.name] = row
        except Exception as exc:  # noqa: BLE001 - a side that fails is reported, the others still run
            rows[side.name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    reference = sides[0].loss_values()
    for side in sides[1:]:
        if "error" in rows[side.name]:
            continue
        got = side.loss_values()
        n = min(len(got), len(reference))
        worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got[:n], reference[:n]))
        rows[side.name]["loss_rel_diff"] = worst
    for side in sides:
        del side.model, side.opt, side.batches
    del dtorch_batches, torch_batches
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_case(family, size, rows, args) -> None:
    base = rows["torch"]
    print(f"{family:6s} {size:6s}", end="")
    for name in ("torch", "eager", "replay"):
        row = rows[name]
        if "error" in row:
            print(f" | {name} FAILED", end="")
            continue
        ratio = row["ms"] / base["ms"] if "ms" in base else float("nan")
        text = f" | {name} {row['ms']:8.2f} ms {ratio:5.2f}x"
        if name != "torch" and args.issue_times:
            text += f" (issued in {row['issue_ms']:.2f})"
        if "kernels" in row:
            text += f" k={row['kernels']} ({row['kernels'] / base['kernels']:.2f}x) gpu {row['cuda_ms']:.2f} ms"
        print(text, end="")
    print()
    for name in ("eager", "replay"):
        row = rows[name]
        if "error" in row:
            print(f"    {name}: {row['error']}")
        elif "loss_rel_diff" in row and row["loss_rel_diff"] > 2e-2:
            print(f"    {name}: losses differ from torch's by {row['loss_rel_diff']:.2e} (relative)")
        if args.top and "names" in row and "names" in base:
            diff = [(k, row["names"][k], base["names"][k]) for k in set(row["names"]) | set(base["names"])
                    if row["names"][k] != base["names"][k]]
            diff.sort(key=lambda t: -abs(t[1] - t[2]))
            for k, mine, theirs in diff[:args.top]:
                print(f"    {name} kernel {mine:4d} vs torch {theirs:4d}  {k[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--families", default=",".join(_blocks.FAMILIES))
    parser.add_argument("--sizes", default=None, help="default small,large on cuda, small on cpu")
    parser.add_argument("--runner", default=None, help="default process on cuda, thread on cpu")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per side (replay captures in them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="count CUDA kernels per step (use --runner thread)")
    parser.add_argument("--top", type=int, default=0, help="with --profile: kernels whose counts differ")
    parser.add_argument("--optim", default="torch", choices=("torch", "dtorch", "fused"),
                        help="the dtorch sides' optimizer: torch.optim.AdamW(foreach=True) or dt.optim.AdamW; "
                             "fused: torch.optim.AdamW(fused=True) on every side")
    parser.add_argument("--issue-times", action="store_true",
                        help="also print how long the controller took to issue each dtorch step")
    parser.add_argument("--json", default=None)
    add_flush_options(parser)
    args = parser.parse_args()
    set_flush_policy(args.flush_batch, args.flush_interval, args.flush_first, args.flush_growth)
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    sizes = (args.sizes or ("small,large" if device == "cuda" else "small")).split(",")
    runner = args.runner or ("process" if device == "cuda" else "thread")

    import dtorch_core as dt

    dt.init(world_size=args.world_size, runner=runner, device_type=device)
    mesh = dt.init_device_mesh(device, (args.world_size,))
    print(f"model steps: device {device} "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), {dtype}, runner {runner}, "
          f"world {args.world_size}, torch {torch.__version__}; median of {args.steps} steps, ratio to torch")
    results = {}
    for family in args.families.split(","):
        for size in sizes:
            rows = run_case(dt, args, family, size, mesh, dtype, device)
            print_case(family, size, rows, args)
            results[f"{family}/{size}"] = {k: {kk: vv for kk, vv in v.items() if kk != "names"}
                                           for k, v in rows.items()}
            sys.stdout.flush()
    dt.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, dtype=str(dtype), runner=runner, world_size=args.world_size,
                           torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
