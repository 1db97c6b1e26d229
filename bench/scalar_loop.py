"""A Python number that changes on every call, against the same loop with fixed numbers.

    python bench/scalar_loop.py [--iters 10000] [--runners thread,process] [--world 2]

Per runner and loop, ``y = x * a + b`` on a small DTensor (Shard(0) of a (8 * world + 1, 8)
tensor: uneven shards), with ``a, b = float(i), 0.5 * i`` (``changing``), ``a, b = 3.0, 0.5``
(``fixed``) or ``a, b = i + 2, 1`` (``int``: ints stay in the plan-cache key, so every call is
planned again; the row shows the cache's bound, planner/cache.py), after a warm-up of 200 calls
of the same loop: the controller's us per call (issue time, then to the workers' end), the
plan-cache entries (``session.plans``) and worker plans (rank 0's table) the loop added, and the
controller's RSS growth. Each row ends with its ratio to the fixed loop of the same runner,
measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dtorch_core as dt  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker_plans(session) -> int:
    return session.memory_stats()[0]["plans"]


LOOPS = {"fixed": lambda i: (3.0, 0.5), "changing": lambda i: (float(i), 0.5 * i), "int": lambda i: (i + 2, 1)}


def run_loop(session, x, iters: int, loop: str) -> dict:
    numbers = LOOPS[loop]

    for i in range(200):  # warm-up: the fixed loop's plans are made here
        a, b = numbers(-1 - i)
        x * a + b
    session.synchronize()
    gc.collect()
    plans0, workers0, rss0 = len(session.plans), _worker_plans(session), _rss_mib()
    t0 = time.perf_counter()
    for i in range(iters):
        a, b = numbers(i)
        y = x * a + b
    t1 = time.perf_counter()
    session.synchronize()
    t2 = time.perf_counter()
    a, b = numbers(iters - 1)
    expected = x.full_tensor() * a + b
    ok = torch.equal(y.full_tensor(), expected)
    return {"issue_us": (t1 - t0) / iters * 1e6, "e2e_us": (t2 - t0) / iters * 1e6,
            "plans": len(session.plans) - plans0, "worker_plans": _worker_plans(session) - workers0,
            "rss_mib": _rss_mib() - rss0, "values_ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10_000)
    ap.add_argument("--runners", default="thread,process")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--loops", default="fixed,changing,int")
    args = ap.parse_args()
    from dtorch_core.planner import native_dispatch
    print(f"torch {torch.__version__}, world {args.world}, {args.iters} calls per loop "
          f"(2 ops each), controller hot path: {native_dispatch.active()}")
    print(f"{'runner':8} {'loop':9} {'issue us':>9} {'e2e us':>8} {'+plans':>7} {'+worker':>8} "
          f"{'+RSS MiB':>9} {'issue/fixed':>11}  values")
    for runner in args.runners.split(","):
        session = dt.init(world_size=args.world, runner=runner)
        mesh = dt.init_device_mesh("cpu", (args.world,))
        x = dt.distribute_tensor(torch.randn(8 * args.world + 1, 8), mesh, [dt.Shard(0)])  # uneven shards
        results = {name: run_loop(session, x, args.iters, name) for name in ["fixed"] + [
            n for n in args.loops.split(",") if n != "fixed"]}
        fixed = results["fixed"]
        for name, r in results.items():
            print(f"{runner:8} {name:9} {r['issue_us']:9.1f} {r['e2e_us']:8.1f} {r['plans']:7d} "
                  f"{r['worker_plans']:8d} {r['rss_mib']:9.1f} {r['issue_us'] / fixed['issue_us']:11.2f}  "
                  f"{'ok' if r['values_ok'] else 'WRONG'}")
        dt.shutdown()


if __name__ == "__main__":
    main()
