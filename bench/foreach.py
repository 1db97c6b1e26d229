"""A foreach AdamW step on dtorch against the same step in plain torch, measured in one run.

    python bench/foreach.py [--params 50] [--size 256] [--steps 20] [--runner thread] [--world-size 2]

Both sides run ``torch.optim.AdamW(foreach=True)`` on ``--params`` parameters of
``size x size`` (float32) with fixed gradients. dtorch's parameters alternate Shard(0),
Shard(1) and Replicate (one mesh dim), so each foreach call covers mixed placements. Printed:
the time of one step (``opt.step()`` then ``dt.synchronize()``: the workers ran it all) on each
side, their ratio, the controller's time to issue a step (``opt.step()`` alone), and the
instructions dtorch issued per step, of which worker plan definitions (AdamW's step sizes change
every step: they travel with the Calls, so none after warm-up).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread on both sides

import argparse
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing dtorch-core

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import DefinePlan


def _params(n: int, size: int) -> list:
    gen = torch.Generator().manual_seed(0)
    ps = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.randn(size, size, generator=gen))
        p.grad = torch.randn(size, size, generator=gen) * 0.01
        ps.append(p)
    return ps


def _time_steps(opt, steps: int, sync) -> float:
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runner", default="thread")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)

    plain = _params(args.params, args.size)
    dt.init(world_size=args.world_size, runner=args.runner)
    try:
        mesh = dt.init_device_mesh("cpu", (args.world_size,))
        choices = [(dt.Shard(0),), (dt.Shard(1),), (dt.Replicate(),)]
        dist = []
        for i, p in enumerate(plain):
            d = torch.nn.Parameter(dt.distribute_tensor(p.detach(), mesh, choices[i % 3]))
            d.grad = dt.distribute_tensor(p.grad, mesh, choices[i % 3])
            dist.append(d)
        opt = torch.optim.AdamW(dist, lr=1e-3, weight_decay=0.01, foreach=True)
        ref = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.01, foreach=True)
        for _ in range(args.warmup):
            opt.step()
            ref.step()
        dt.synchronize()
        ours = _time_steps(opt, args.steps, dt.synchronize)
        theirs = _time_steps(ref, args.steps, lambda: None)
        issue = _time_steps(opt, args.steps, lambda: None)
        dt.synchronize()
        with current_session().recording() as rec:  # last: a recording leaves the session as it was
            opt.step()
        dt.synchronize()
        per_step = len(rec.instructions)
        defines = sum(type(i) is DefinePlan for i in rec.instructions)
    finally:
        dt.shutdown()
    print(f"AdamW(foreach=True), {args.params} params of {args.size}x{args.size}, "
          f"{args.runner} runner, world {args.world_size}, median of {args.steps} steps")
    print(f"  plain torch            {theirs * 1e3:9.2f} ms/step  1.00x")
    print(f"  dtorch                 {ours * 1e3:9.2f} ms/step  {ours / theirs:.2f}x torch")
    print(f"  dtorch issue only      {issue * 1e3:9.2f} ms/step  {issue / theirs:.2f}x torch")
    print(f"  dtorch instructions    {per_step} per step, {defines} of them worker plan definitions")
    print(f"ratio dtorch/torch {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
