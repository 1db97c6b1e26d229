"""Tensor-parallel scaling of a transformer block: dtorch against PyTorch DTensor on the same
devices, in one run (issue 7, run 2).

    python bench/tp_scaling.py                                  # cuda, bf16, d=8192, tp 1 and 2
    python bench/tp_scaling.py --tp 1 2 4 8 --steps 10 --rounds 3
    python bench/tp_scaling.py --device cpu --d-model 256 --seq-len 64 --batch 2 --dtype float32   # test

For each tp in ``--tp`` (world size = tp; tp <= the number of GPUs):
  dtorch         ``dt.init(device_type="cuda", runner="process", world_size=tp)`` (the dtorch_nccl
                 plugin, NCCL), the block distributed with ``dt.nn.parallelize_module`` (column-wise
                 q/k/v/fc, row-wise projections), each step issued eagerly by the controller
  dtorch replay  the same step under ``dt.compile`` (a second copy of the block; replayed from its
                 4th call; ``--no-compile`` leaves it out)
  DTensor        the same block and plan with ``torch.distributed.tensor.parallel`` under
                 ``torchrun --nproc_per_node tp`` (bench/_dtensor_tp_block.py), the anchor
A step is forward and backward of the block (bench/_tp_block.py), timed alone and ended by
``dt.synchronize()`` (DTensor: ``torch.cuda.synchronize()`` and a barrier). Warm-up steps are not
timed; the rounds of the sides interleave; the median step of all timed steps is reported. Per
tp: ratio dtorch/DTensor step time (target <= 1.0) and each side's scaling efficiency
t(tp=1) / (tp * t(tp)) (needs tp 1 in the list).

With ``--init cpu`` (the default on cpu) every side gets the same weights (built on the CPU from
the seed) and the check values of one more step are compared; ``--init device`` (the default on
cuda: no 0.8 B-parameter block built on a CPU) draws the weights where they live.
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set here,
before torch is imported, and inherited by the dtorch workers and the torchrun ranks.
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the torchrun ranks get 1 too (bench/_torchrun.py)
os.environ.setdefault("DTORCH_WORKER_NICE", "0")  # as bench/train_step.py: no renicing of the workers

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
sys.path.insert(0, BENCH_DIR)
import _tp_block  # noqa: E402  (puts the repository root on sys.path too)
from _torchrun import TorchrunAnchor  # noqa: E402

ANCHOR = os.path.join(BENCH_DIR, "_dtensor_tp_block.py")
STATS = {"min": min, "median": statistics.median}
REPLAY_AFTER = 3  # dt.compile: one warm-up call and two recorded ones, then replays
RTOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 3e-2}


class DtorchBlock:
    """One copy of the block on the tp mesh, stepped by ``fn`` (fwd_bwd itself or dt.compile of it)."""

    def __init__(self, dt, args, mesh, fn, seed_offset: int):
        self.dt, self.fn = dt, fn
        col, row = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
        plan = {**{n: col() for n in _tp_block.PLAN_COL}, **{n: row() for n in _tp_block.PLAN_ROW}}
        if _tp_block.init_mode(args) == "cpu":
            self.block = dt.nn.parallelize_module(_tp_block.build_block(args), mesh, plan)
        else:
            # nothing built on the controller: uninitialised shards on the workers, drawn there
            block = _tp_block.build_block(args, "meta")
            from dtorch_core.api import meta_as_uninitialised

            with meta_as_uninitialised():
                self.block = dt.nn.parallelize_module(block, mesh, plan)
            dt.manual_seed(args.seed + seed_offset)
            with torch.no_grad():
                for p in self.block.parameters():
                    p.normal_(0.0, 0.02)
        replicate = [dt.Replicate()]
        x, g = _tp_block.inputs(args)
        self.x = dt.distribute_tensor(x, mesh, replicate)
        self.g = dt.distribute_tensor(g, mesh, replicate)
        for _ in range(args.warmup):
            self.fn(self.block, self.x, self.g)
        dt.synchronize()

    def round(self, steps: int) -> list[float]:
        gc.collect()
        self.dt.synchronize()
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.fn(self.block, self.x, self.g)
            self.dt.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    def checks(self) -> dict:
        self.block.zero_grad(set_to_none=True)
        y = self.block(self.x)
        y.backward(self.g)
        grad_sq = self.block.mlp.fc.weight.grad.float().pow(2).sum()
        return {"y_mean_square": y.float().pow(2).mean().full_tensor().item(),
                "fc_grad_sum_square": grad_sq.full_tensor().item()}


def run_tp(args, tp: int) -> dict:
    """Every side at one tp, rounds interleaved; returns samples and checks."""
    import dtorch_core as dt

    anchor_argv = _tp_block.block_args(args) + ["--warmup", args.warmup, "--steps", args.steps,
                                                "--rounds", args.rounds]
    anchor = TorchrunAnchor(ANCHOR, anchor_argv, tp, args.anchor_timeout)  # starts now, beside ours
    samples = {"dtorch": [], "replay": [], "dtensor": []}
    started = False
    try:
        t0 = time.perf_counter()
        dt.init(world_size=tp, runner=args.runner, device_type=args.device)
        started = True
        # The anchor's warm-up runs NCCL collectives on the same GPUs: let it finish before ours
        # start (two jobs' collectives interleaved on shared GPUs only time-slice, at best).
        anchor.wait_ready()
        mesh = dt.init_device_mesh(args.device, (tp,), mesh_dim_names=("tp",))
        eager = DtorchBlock(dt, args, mesh, _tp_block.fwd_bwd, 0)
        compiled = None
        if args.compile:
            compiled = dt.compile(_tp_block.fwd_bwd)
            replay = DtorchBlock(dt, args, mesh, compiled, 1)
            replays_before = compiled.replays
        setup_s = time.perf_counter() - t0
        for r in range(args.rounds):
            samples["dtorch"] += eager.round(args.steps)
            if compiled is not None:
                samples["replay"] += replay.round(args.steps)
            samples["dtensor"] += anchor.run_round(r, "step")["step_seconds"]
        checks = {"dtorch": eager.checks()}
        replays = compiled.replays - replays_before if compiled is not None else None
        if compiled is not None:
            checks["replay"] = replay.checks()
        memory = dt.memory_stats()
        fallbacks = dt.fallback_counts()
        eager = replay = None
        dt.shutdown()
        started = False
        final = anchor.finish()
        checks["dtensor"] = final.pop("checks")
    finally:
        if started:
            dt.shutdown()
        anchor.close()
    if not samples["replay"]:
        del samples["replay"]
    return {"samples": samples, "checks": checks, "replays": replays, "dtorch_setup_s": setup_s,
            "dtorch_memory": memory, "dtorch_fallbacks": fallbacks,
            "dtensor_env": {k: v for k, v in final.items() if k != "samples"}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _tp_block.add_block_options(parser)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp sizes (world = tp), default 1 2")
    parser.add_argument("--runner", default="process", help="dtorch runner (default process)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and side (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=REPLAY_AFTER + 1,
                        help=f"untimed steps first (default {REPLAY_AFTER + 1}; at least {REPLAY_AFTER})")
    parser.add_argument("--stat", choices=sorted(STATS), default="median")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the dt.compile'd step (replay); default on")
    parser.add_argument("--json", dest="json_out", help="also write every sample and the summary here")
    parser.add_argument("--anchor-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    # `timeout` sends SIGTERM: unwind, so the finally blocks stop the torchrun anchor (its own
    # session, out of timeout's reach) and the dtorch workers instead of leaving them on the GPUs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.warmup < REPLAY_AFTER:
        parser.error(f"--warmup must be at least {REPLAY_AFTER}: dt.compile replays from its 4th call")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("tp_scaling: --device cuda needs a GPU; torch sees none (use --device cpu to test)", file=sys.stderr)
            return 2
        if max(args.tp) > torch.cuda.device_count():
            parser.error(f"--tp {max(args.tp)} needs that many GPUs; torch sees {torch.cuda.device_count()}")
    else:
        torch.set_num_threads(1)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    started = time.perf_counter()
    results = {}
    for tp in args.tp:
        results[tp] = run_tp(args, tp)
        # a line per tp as soon as it is measured: a later tp that hangs leaves this one readable
        part = {k: STATS[args.stat](v) * 1e3 for k, v in results[tp]["samples"].items()}
        print(f"tp={tp} done ({time.perf_counter() - started:.0f}s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in part.items())
              + f"; dtorch/DTensor {part['dtorch'] / part['dtensor']:.3f}", flush=True)
    elapsed = time.perf_counter() - started

    stat = STATS[args.stat]
    ms = {tp: {k: stat(v) * 1e3 for k, v in res["samples"].items()} for tp, res in results.items()}
    sides = list(next(iter(ms.values())))
    labels = {"dtorch": f"dtorch ({args.runner}, eager)", "replay": "dtorch replay (dt.compile)",
              "dtensor": "DTensor (torchrun)"}
    ok = True
    compare = _tp_block.init_mode(args) == "cpu"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tflop = _tp_block.flops(args) / 1e12
    print()
    print(f"tp_scaling: transformer block d={args.d_model}, heads {args.heads}, ff {4 * args.d_model}, batch "
          f"{args.batch}, seq {args.seq_len}, {args.dtype}, forward+backward ({tflop:.2f} TFLOP a step); "
          f"{args.device} ({gpu}), torch {torch.__version__}, python {platform.python_version()}")
    print(f"{args.warmup} warm-up steps, {args.rounds} interleaved rounds x {args.steps} timed steps per side, "
          f"{args.stat} step; init {_tp_block.init_mode(args)}; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    for tp, res in results.items():
        c = res["checks"]
        text = ", ".join(f"{k}: y_ms {v['y_mean_square']:.6g} grad_ss {v['fc_grad_sum_square']:.6g}" for k, v in c.items())
        if compare:
            worst = max(rel(v[m], c["dtensor"][m]) for k, v in c.items() for m in v)
            good = worst <= RTOL[args.dtype]
            ok &= good
            text += f"; max rel diff vs DTensor {worst:.1e} ({'ok' if good else 'MISMATCH'})"
        if res["replays"] is not None and res["replays"] != args.rounds * args.steps:
            text += f"; ONLY {res['replays']} OF {args.rounds * args.steps} COMPILED STEPS REPLAYED"
            ok = False
        print(f"tp={tp} checks: {text}; dtorch setup {res['dtorch_setup_s']:.1f}s; "
              f"fallbacks {res['dtorch_fallbacks'] or 'none'}")
    print()
    head = f"{'tp':>3}  " + "".join(f"{labels[s] + ' ms':>30}" for s in sides)
    head += f"{'dtorch/DTensor':>16}" + (f"{'replay/DTensor':>16}" if "replay" in sides else "")
    head += "".join(f"{'eff ' + s:>14}" for s in sides)
    print(head)
    ratios = {}
    for tp, row in ms.items():
        line = f"{tp:>3}  " + "".join(f"{row[s]:>30.2f}" for s in sides)
        ratios[tp] = {s: row[s] / row["dtensor"] for s in sides if s != "dtensor"}
        line += f"{ratios[tp]['dtorch']:>16.3f}" + (f"{ratios[tp]['replay']:>16.3f}" if "replay" in sides else "")
        for s in sides:
            line += f"{ms[1][s] / (tp * row[s]):>14.3f}" if 1 in ms else f"{'n/a':>14}"
        print(line)
    print()
    print("TFLOP/s (per step, all GPUs together): " + "; ".join(
        f"tp={tp} " + ", ".join(f"{s} {tflop / (row[s] / 1e3):.0f}" for s in sides) for tp, row in ms.items()))
    print(f"bench wall time {elapsed:.1f}s")
    for tp in ms:
        print(f"tp={tp}: ratio dtorch/dtensor step time = {ratios[tp]['dtorch']:.3f} (target <= 1.0)"
              + (f"; replay/dtensor = {ratios[tp]['replay']:.3f}" if "replay" in sides else ""))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json_out"}, "gpu": gpu,
                       "torch": torch.__version__, "step_ms": ms, "ratios_over_dtensor": ratios,
                       "results": results, "wall_time_s": elapsed}, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
