"""Collective bandwidth seen through dtorch redistributions against torch.distributed called
directly on the same devices, in one run (issue 7, run 3).

    python bench/collectives.py                        # cuda, world = all GPUs, 1 MiB 16 MiB 256 MiB 1 GiB
    python bench/collectives.py --sizes 1M 64M --iters 10
    python bench/collectives.py --device cpu --world-size 2 --sizes 64K 1M --iters 5   # test (gloo)

Per collective and size S (bytes of the global tensor, float32 by default):
  all_gather      dtorch Shard(0) -> Replicate   torch all_gather_into_tensor
  reduce_scatter  dtorch Partial  -> Shard(0)    torch reduce_scatter_tensor
  all_reduce      dtorch Partial  -> Replicate   torch all_reduce
  all_to_all      dtorch Shard(0) -> Shard(1)    torch all_to_all_single (no transposing copies)
dtorch: ``dt.init(device_type=..., runner="process")`` (on cuda the dtorch_nccl plugin: NCCL);
the source tensor is made on the workers, then ``--iters`` redistributions are issued (each
result dropped as the next is issued) and ``dt.synchronize()`` ends the round; time / iters.
torch: bench/_torch_collectives.py under ``torchrun --nproc_per_node world``, ``--iters`` calls
then ``torch.cuda.synchronize()`` and a barrier; time / iters. The rounds of both sides
interleave (bench/_torchrun.py); the ``--stat`` (default median) round counts. Printed per row:
algbw and busbw in nccl-tests' conventions (bench/_collectives_common.py) and the ratio
dtorch/torch of bandwidth (= torch time / dtorch time; target >= 0.95). A second table gives
per row the time ratio dtorch/torch (at small sizes, where the time is host cost: target <= 1.3)
and the host CPU per redistribution: CPU time of the controller and every worker process (from
the scheduler's counters) against that of every torchrun rank per direct call.
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DTORCH_WORKER_NICE", "0")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, REPO_ROOT)  # run from a checkout without installing dtorch-core
import _collectives_common as cc  # noqa: E402
from _torchrun import TorchrunAnchor  # noqa: E402

ANCHOR = os.path.join(BENCH_DIR, "_torch_collectives.py")
STATS = {"min": min, "median": statistics.median}
DEFAULT_SIZES = {"cuda": ["1M", "16M", "256M", "1G"], "cpu": ["64K", "1M"]}


def placements(dt, op):
    S0, S1, R, P = dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial()
    return {"all_gather": (S0, R), "reduce_scatter": (P, S0), "all_reduce": (P, R), "all_to_all": (S0, S1)}[op]


def worker_pids() -> list:
    """The worker processes of the running session (none for runners whose workers are threads
    of this process: its own CPU time counts them)."""
    from dtorch_core.controller import session as session_module

    return [p.pid for p in getattr(session_module._session.runner, "procs", ())]


def cpu_total(pids) -> float:
    return cc.cpu_seconds() + sum(cc.cpu_seconds(pid) for pid in pids)


class DtorchCollective:
    """One (op, size): the source on the workers, timed rounds of ``iters`` redistributions."""

    def __init__(self, dt, mesh, op, size, dtype, world, warmup):
        self.dt, self.mesh = dt, mesh
        src, self.dst = placements(dt, op)
        rows, cols = cc.shape_for(size, dtype, world)
        self.x = dt.ones(rows, cols, device_mesh=mesh, placements=[src], dtype=dtype)
        for _ in range(warmup):
            y = self.x.redistribute(mesh, [self.dst])
        y = None  # noqa: F841
        dt.synchronize()

    def round(self, iters: int, pids) -> tuple[float, float]:
        """(seconds, CPU seconds of the controller and every worker process) per redistribution."""
        dt, mesh, dst = self.dt, self.mesh, [self.dst]
        dt.synchronize()
        c0 = cpu_total(pids)
        t0 = time.perf_counter()
        for _ in range(iters):
            y = self.x.redistribute(mesh, dst)
        y = None  # noqa: F841
        dt.synchronize()
        t = (time.perf_counter() - t0) / iters
        return t, (cpu_total(pids) - c0) / iters

    def check(self, world: int) -> bool:
        """The result's values: ones gathered, a sum of one ones-tensor (dt.ones with Partial
        holds ones once in the sum), ones moved."""
        y = self.x.redistribute(self.mesh, [self.dst]).full_tensor()
        return bool(torch.all(y == 1).item())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world-size", type=int, default=None, help="devices (default: every GPU on cuda, 2 on cpu)")
    p.add_argument("--runner", default="process")
    p.add_argument("--dtype", choices=sorted(cc.DTYPES), default="float32")
    p.add_argument("--ops", nargs="+", choices=cc.OPS, default=list(cc.OPS))
    p.add_argument("--sizes", nargs="+", default=None,
                   help="global tensor sizes, e.g. 1M 16M 256M 1G (default cuda: 1M 16M 256M 1G; cpu: 64K 1M)")
    p.add_argument("--iters", type=int, default=20, help="collectives per timed round (default 20)")
    p.add_argument("--big-iters", type=int, default=5, help="collectives per round for sizes >= 256 MiB (default 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stat", choices=sorted(STATS), default="median")
    p.add_argument("--check-max", type=cc.parse_size, default=16 << 20,
                   help="check the values of dtorch's results up to this size (default 16M)")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--anchor-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    # `timeout` sends SIGTERM: unwind, so the finally blocks stop the torchrun anchor (its own
    # session, out of timeout's reach) and the dtorch workers instead of leaving them on the GPUs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("collectives: --device cuda needs a GPU; torch sees none (use --device cpu to test)", file=sys.stderr)
            return 2
        world = args.world_size or torch.cuda.device_count()
    else:
        torch.set_num_threads(1)
        world = args.world_size or 2
    sizes = [cc.parse_size(s) for s in (args.sizes or DEFAULT_SIZES[args.device])]
    dtype = cc.DTYPES[args.dtype]
    for s in sizes:
        cc.shape_for(s, dtype, world)  # fail before anything starts
    iters = {s: args.big_iters if s >= 256 << 20 else args.iters for s in sizes}
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import dtorch_core as dt

    started = time.perf_counter()
    anchor_argv = ["--device", args.device, "--dtype", args.dtype, "--ops", *args.ops,
                   "--sizes", *map(str, sizes), "--iters", args.iters, "--big-iters", args.big_iters,
                   "--warmup", args.warmup, "--rounds", args.rounds]
    anchor = TorchrunAnchor(ANCHOR, anchor_argv, world, args.anchor_timeout)
    samples = {(op, s): {"dtorch": [], "torch": []} for s in sizes for op in args.ops}
    cpu = {(op, s): {"dtorch": [], "torch": []} for s in sizes for op in args.ops}
    checks = {}
    session = False
    try:
        dt.init(world_size=world, runner=args.runner, device_type=args.device)
        session = True
        mesh = dt.init_device_mesh(args.device, (world,))
        pids = worker_pids()
        anchor.wait_ready()
        for r in range(args.rounds):
            for s in sizes:
                for op in args.ops:
                    side = DtorchCollective(dt, mesh, op, s, dtype, world, args.warmup if r == 0 else 1)
                    seconds, cpu_seconds = side.round(iters[s], pids)
                    samples[op, s]["dtorch"].append(seconds)
                    cpu[op, s]["dtorch"].append(cpu_seconds)
                    if r == 0 and s <= args.check_max:  # the check fetches the result to this process
                        checks[op, s] = side.check(world)
                    side = None
                    gc.collect()
                    dt.synchronize()
                    done = anchor.run_round(r, f"{op}-{s}")
                    samples[op, s]["torch"].append(done["seconds"])
                    cpu[op, s]["torch"].append(done["cpu_seconds"])
                    print(f"round {r} {op} {cc.format_size(s)}: dtorch {samples[op, s]['dtorch'][-1] * 1e6:.1f} us, "
                          f"torch {samples[op, s]['torch'][-1] * 1e6:.1f} us", flush=True)
        fallbacks = dt.fallback_counts()
        dt.shutdown()
        session = False
        final = anchor.finish()
    finally:
        if session:
            dt.shutdown()
        anchor.close()
    elapsed = time.perf_counter() - started

    stat = STATS[args.stat]
    gpu = final["device"]
    print(f"collectives: dtorch redistributions ({args.runner} runner) vs torch.distributed directly, world {world}, "
          f"{args.device} ({gpu}), {args.dtype}; torch {torch.__version__}, NCCL {final.get('nccl_version')}, "
          f"python {platform.python_version()}")
    print(f"{args.rounds} interleaved rounds, {args.stat} round; iters per round {args.iters} "
          f"({args.big_iters} at >= 256 MiB); NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}; "
          f"dtorch fallbacks {fallbacks or 'none'}")
    bad = [f"{op} {cc.format_size(s)}" for (op, s), good in checks.items() if not good]
    print(f"dtorch result values (sizes <= {cc.format_size(args.check_max)}): "
          + ("all ok" if not bad else "WRONG: " + ", ".join(bad)))
    print()
    print(f"{'collective':<16}{'size':>9}{'dtorch us':>12}{'torch us':>12}{'dtorch algbw':>14}{'busbw':>8}"
          f"{'torch algbw':>13}{'busbw':>8}{'dtorch/torch':>14}")
    rows = []
    for s in sizes:
        for op in args.ops:
            t = {k: stat(v) for k, v in samples[op, s].items()}
            nbytes = cc.nccl_tests_bytes(op, s, world)
            alg = {k: nbytes / v / 1e9 for k, v in t.items()}
            bus = {k: v * cc.bus_factor(op, world) for k, v in alg.items()}
            ratio = t["torch"] / t["dtorch"]
            host = {k: stat(v) for k, v in cpu[op, s].items()}
            rows.append({"op": op, "size": s, "seconds": t, "algbw_GBps": alg, "busbw_GBps": bus, "ratio": ratio,
                         "cpu_seconds": host, "samples": samples[op, s], "cpu_samples": cpu[op, s]})
            print(f"{op:<16}{cc.format_size(s):>9}{t['dtorch'] * 1e6:>12.1f}{t['torch'] * 1e6:>12.1f}"
                  f"{alg['dtorch']:>14.2f}{bus['dtorch']:>8.2f}{alg['torch']:>13.2f}{bus['torch']:>8.2f}{ratio:>14.3f}")
    print("(GB/s = 1e9 bytes/s; target dtorch/torch >= 0.95)")
    print()
    print("time and host CPU per redistribution against the direct call (CPU: the controller and every worker "
          "process, against every torchrun rank; target time ratio <= 1.3 where host cost dominates)")
    print(f"{'collective':<16}{'size':>9}{'time x':>9}{'dtorch cpu us':>15}{'torch cpu us':>14}{'cpu x':>8}")
    for row in rows:
        host, t = row["cpu_seconds"], row["seconds"]
        print(f"{row['op']:<16}{cc.format_size(row['size']):>9}{t['dtorch'] / t['torch']:>9.2f}"
              f"{host['dtorch'] * 1e6:>15.1f}{host['torch'] * 1e6:>14.1f}{host['dtorch'] / host['torch']:>8.2f}")
    print(f"bench wall time {elapsed:.1f}s")
    worst = min(rows, key=lambda r: r["ratio"])
    largest = [r for r in rows if r["size"] == max(sizes)]
    print("ratio dtorch/torch bandwidth at " + cc.format_size(max(sizes)) + ": "
          + ", ".join(f"{r['op']} {r['ratio']:.3f}" for r in largest)
          + f"; worst {worst['op']} {cc.format_size(worst['size'])} {worst['ratio']:.3f} (target >= 0.95)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json_out"}, "world": world,
                       "anchor": final, "rows": rows, "checks_ok": not bad, "wall_time_s": elapsed},
                      f, indent=2, default=str)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
