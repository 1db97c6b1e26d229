"""The controller's CPU per call of the torch calls real models make, against plain torch.

    python bench/op_costs.py [--runner process] [--device cpu] [--calls 300] [--rounds 5]

Each case is one torch-level call (``F.linear`` on a 3-D input, ``F.rms_norm``, a view, ...) on
replicated DTensors of world 1 and on the same plain tensors: the calling thread's CPU time per
call (``time.thread_time``, the best of ``--rounds`` rounds of ``--calls`` calls, workers synced
between rounds), the difference and the ratio, and how many aten ops the call is on the subclass
(a composite such as ``F.linear`` on a 3-D input decomposes into several, each a dispatch; a
distributed model's ``nn.Linear`` runs dtorch's one-op linear, ``nn.Linear 3-D``). The ``f+b``
rows are a forward, ``sum()`` and backward on inputs that require grad. The
worker's time is not in the figure: this is what bounds an eager step whose device is faster
than its controller (bench/RESULTS.md, issue 14).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.nn.linear import linear

CASES = {
    "add": lambda a, w, b, y: a + y,
    "mul": lambda a, w, b, y: a * y,
    "view": lambda a, w, b, y: a.view(-1, a.shape[-1]),
    "unsqueeze": lambda a, w, b, y: a.unsqueeze(1),
    "t": lambda a, w, b, y: w.t(),
    "linear 3-D": lambda a, w, b, y: F.linear(a, w, b),
    "nn.Linear 3-D": lambda a, w, b, y: linear(a, w, b),  # what a distributed model's Linear runs
    "cat": lambda a, w, b, y: torch.cat([a, y], dim=-1),
    "rms_norm": lambda a, w, b, y: F.rms_norm(a, (a.shape[-1],)),
    "layer_norm": lambda a, w, b, y: F.layer_norm(a, (a.shape[-1],)),
    "chunk(4)": lambda a, w, b, y: a.chunk(4, dim=-1),
}
# forward and backward, on inputs that require grad (the sum and its backward on both sides)
GRAD_CASES = {
    "linear f+b": lambda a, w, b, y: F.linear(a, w, b).sum().backward(),
    "nn.Linear f+b": lambda a, w, b, y: linear(a, w, b).sum().backward(),
}


def cpu_per_call(fn, args, calls: int, rounds: int, sync) -> float:
    for _ in range(50):
        fn(*args)
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.thread_time() - t0) / calls)
        sync()
    return best * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", default="process")
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    dt.init(world_size=1, runner=args.runner, device_type=args.device)
    try:
        from dtorch_core import _fastpath
        counts = _fastpath.counts
    except ImportError:
        counts = None
    mesh = dt.init_device_mesh(args.device, (1,))
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(*s, generator=g).to(args.device) for s in ((1, 64, 32), (48, 32), (48,), (1, 64, 32))]
    dist = [dt.distribute_tensor(t, mesh, [dt.Replicate()]) for t in plain]
    sync_torch = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"controller CPU per call, us (runner {args.runner}, device {args.device}, world 1, torch {torch.__version__})")
    print(f"{'call':12s} {'torch':>8s} {'dtorch':>8s} {'extra':>8s} {'ratio':>7s} {'aten ops':>9s}")
    grads = ([t.detach().clone().requires_grad_() for t in plain], [t.detach().clone().requires_grad_() for t in dist])
    for name, fn in [*CASES.items(), *GRAD_CASES.items()]:
        on_plain, on_dist = grads if name in GRAD_CASES else (plain, dist)
        t = cpu_per_call(fn, on_plain, args.calls, args.rounds, sync_torch)
        d = cpu_per_call(fn, on_dist, args.calls, args.rounds, dt.synchronize)
        ops = "-"
        if counts is not None:
            before = sum(counts())
            fn(*on_dist)
            ops = str(sum(counts()) - before)
        print(f"{name:12s} {t:8.2f} {d:8.2f} {d - t:+8.2f} {d / t:6.2f}x {ops:>9s}")
    dt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
