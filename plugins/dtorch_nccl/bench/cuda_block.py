"""dtorch on one GPU against plain torch on the same GPU, printed as ratios measured in one run.

1. ``block``: a bf16 transformer MLP block (LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual),
   forward and backward, large enough to be compute bound (d=8192, 8192 tokens: about 26 TFLOP a
   step). dtorch runs it on one worker process (``runner="process"``, world size 1, CUDA); the
   anchor is the same block in plain torch in this process. Target: throughput ratio >= 0.97.
2. ``chain``: 1,000 small dependent ops (``x * 1.0001`` and ``x + 1e-4`` alternating, 1,024
   floats), called 10 times back to back then synchronised: per-op cost of dtorch eager, of dtorch
   replay (``dt.compile``; "n/a" where this dtorch has no ``dt.compile``), of plain torch eager
   and of plain torch CUDA-graph replay. Target: dtorch replay within 1.5x of torch graph replay.

    python plugins/dtorch_nccl/bench/cuda_block.py                 # both parts
    python plugins/dtorch_nccl/bench/cuda_block.py --only chain    # or block
    python plugins/dtorch_nccl/bench/cuda_block.py --json out.json

Rounds alternate the sides (torch, dtorch, torch, ...) and the least disturbed round counts.
Run from a dtorch checkout with dtorch_nccl installed (or importable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value  # inherited by the worker processes

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout's dtorch_core

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dtorch_core as dt  # noqa: E402

R = dt.Replicate()


# ---------------------------------------------------------------------------------------------
# the block
# ---------------------------------------------------------------------------------------------
def block_forward(x, p, d):
    h = F.layer_norm(x, (d,), p["ln_w"], p["ln_b"])
    h = F.gelu(F.linear(h, p["w1"], p["b1"]), approximate="tanh")
    return x + F.linear(h, p["w2"], p["b2"])


def block_shapes(d, hidden):
    return {"ln_w": (d,), "ln_b": (d,), "w1": (hidden, d), "b1": (hidden,), "w2": (d, hidden), "b2": (d,)}


def block_flops(tokens, d, hidden) -> float:
    return 3 * 2 * (2 * tokens * d * hidden)  # two linears, forward + backward (2x forward)


def torch_block(args):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    hidden = 4 * args.d
    p = {k: (torch.randn(s, device=dev, dtype=dtype) * 0.02).requires_grad_(True)
         for k, s in block_shapes(args.d, hidden).items()}
    x = torch.randn(args.tokens, args.d, device=dev, dtype=dtype).requires_grad_(True)
    g = torch.randn(args.tokens, args.d, device=dev, dtype=dtype)

    def step():
        for t in list(p.values()) + [x]:
            t.grad = None
        block_forward(x, p, args.d).backward(g)

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    return timed


def dtorch_block(args, mesh):
    dtype = torch.bfloat16
    hidden = 4 * args.d
    p = {}
    for k, s in block_shapes(args.d, hidden).items():
        w = dt.randn(*s, device_mesh=mesh, placements=[R], dtype=dtype)  # made on the worker
        w.mul_(0.02)
        p[k] = w.requires_grad_(True)
    x = dt.randn(args.tokens, args.d, device_mesh=mesh, placements=[R], dtype=dtype).requires_grad_(True)
    g = dt.randn(args.tokens, args.d, device_mesh=mesh, placements=[R], dtype=dtype)

    def step():
        for t in list(p.values()) + [x]:
            t.grad = None
        block_forward(x, p, args.d).backward(g)

    def timed(n):
        dt.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        dt.synchronize()
        return (time.perf_counter() - t0) / n

    return timed


def run_block(args, mesh) -> dict:
    sides = {"torch": torch_block(args), "dtorch": dtorch_block(args, mesh)}
    for f in sides.values():
        f(args.warmup)
    samples = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, f in sides.items():
            samples[k].append(f(args.iters))
    best = {k: min(v) for k, v in samples.items()}
    flops = block_flops(args.tokens, args.d, 4 * args.d)
    return {
        "step_s": best,
        "tflops": {k: flops / v / 1e12 for k, v in best.items()},
        "throughput_ratio": best["torch"] / best["dtorch"],
        "samples_s": samples,
    }


# ---------------------------------------------------------------------------------------------
# the chain of small ops
# ---------------------------------------------------------------------------------------------
def chain(x, n):
    for i in range(n // 2):
        x = x * 1.0001
        x = x + 1e-4
    return x


def _per_op(fn, n_ops, rounds, sync, calls=1):
    """Least per-op time over ``rounds`` of ``calls`` back-to-back calls and one sync."""
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / (n_ops * calls))
    return min(out)


def run_chain(args, mesh) -> dict:
    n = args.chain
    x = torch.ones(1024, device="cuda")
    res = {}
    chain(x, n)
    c = args.calls
    res["torch eager"] = _per_op(lambda: chain(x, n), n, args.rounds * 2, torch.cuda.synchronize, c)

    static = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            chain(static, n)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(static, n)
    graph.replay()
    res["torch CUDA-graph replay"] = _per_op(graph.replay, n, args.rounds * 2, torch.cuda.synchronize, c)

    xd = dt.ones(1024, device_mesh=mesh, placements=[R])
    chain(xd, n)
    dt.synchronize()
    issue = []

    def dtorch_eager():
        t0 = time.perf_counter()
        y = chain(xd, n)
        issue.append((time.perf_counter() - t0) / n)
        return y

    res["dtorch eager"] = _per_op(dtorch_eager, n, args.rounds * 2, dt.synchronize, c)
    res["dtorch eager, controller issue only"] = min(issue)

    if hasattr(dt, "compile"):
        try:
            step = dt.compile(lambda t: chain(t, n))
            for _ in range(4):  # warm-up, recordings, first replay
                step(xd)
            dt.synchronize()
            res["dtorch replay"] = _per_op(lambda: step(xd), n, args.rounds * 2, dt.synchronize, c)
            # one call and its sync alone: the controller-worker round trip shows here
            res["dtorch replay, 1 call + sync"] = _per_op(lambda: step(xd), n, args.rounds * 2, dt.synchronize)
        except Exception as exc:  # reported, not hidden: the row says why it is missing
            res["dtorch replay"] = f"failed: {type(exc).__name__}: {exc}"
    else:
        res["dtorch replay"] = "n/a (capture/replay not yet available)"
    return res


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["block", "chain"], default=None)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10, help="block steps per timed round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chain", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=10, help="chain calls per timed round (then one sync)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_block: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2

    dt.init(world_size=1, runner="process", device_type="cuda")
    mesh = dt.init_device_mesh("cuda", (1,))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    try:
        if args.only in (None, "block"):
            out["block"] = run_block(args, mesh)
        if args.only in (None, "chain"):
            out["chain"] = run_chain(args, mesh)
    finally:
        dt.shutdown()

    print(f"{out['gpu']}, torch {out['torch']}; dtorch: process runner, world size 1, device_type='cuda'")
    if "block" in out:
        b = out["block"]
        print(f"\nbf16 MLP block, d={args.d}, {args.tokens} tokens, forward+backward "
              f"(best of {args.rounds} rounds x {args.iters} steps)")
        for k in ("torch", "dtorch"):
            print(f"  {k:8s} {b['step_s'][k] * 1e3:8.2f} ms/step  {b['tflops'][k]:6.1f} TFLOP/s")
        print(f"  dtorch/torch throughput ratio: {b['throughput_ratio']:.3f}  (target >= 0.97)")
    if "chain" in out:
        c = out["chain"]
        base, graph = c["torch eager"], c["torch CUDA-graph replay"]
        print(f"\nchain of {args.chain} small ops (1024 floats), per op (best of {args.rounds * 2} rounds of "
              f"{args.calls} calls and one sync)")
        for k, v in c.items():
            if isinstance(v, float):
                print(f"  {k:38s} {v * 1e6:8.2f} us   {v / base:6.2f}x torch eager   {v / graph:6.2f}x torch graph")
            else:
                print(f"  {k:38s} {v}")
        if isinstance(c["dtorch replay"], float):
            print(f"  dtorch replay / torch CUDA-graph replay: {c['dtorch replay'] / graph:.2f}  (target <= 1.5)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
