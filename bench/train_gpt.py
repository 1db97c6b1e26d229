"""Training throughput of examples/train_gpt.py's GPT: dtorch vs PyTorch DTensor vs plain torch, in one run.

    python bench/train_gpt.py [--runner process] [--steps 5] [--rounds 3] [--warmup 3] [--json out.json]
    python bench/train_gpt.py --runner remote   # remote (dtorch-zmq) and process runners, side by side

Sides (see bench/README.md), all training the same model from the same seed on the same batches:
  dtorch       dp x tp mesh of CPU devices (dt.nn.parallelize_module on "tp", dt.nn.data_parallel
               on "dp"), one controller, --runner (default process)
  DTensor      the same parallel plan with torch.distributed.tensor.parallel on a 2-D DeviceMesh,
               data parallel with DTensor replicate, torchrun x (dp * tp) processes, gloo
  plain torch  the unsharded model in this process (one device)
Tokens/s = timed steps x global batch x sequence length / wall time of a round (dtorch: until
every worker has finished, dt.synchronize()). Every figure is printed with its ratio to DTensor's
from the same run; the last line is the headline ``ratio dtorch/dtensor tokens/s``. With
``--runner remote`` (``dtorch worker`` processes on 127.0.0.1, launcher mode) the process runner
trains beside it in the same run, and the last line is ``ratio remote/process step time``.
"""

from __future__ import annotations

import os

# Fairness: one intra-op thread everywhere (this process, its worker threads or processes, and
# the torchrun ranks). Set before torch is imported so OpenMP picks it up.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("DTORCH_WORKER_THREADS", "1")

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

import _gpt
from _remote import BenchSession, require_remote, worker_nice
from _torchrun import TorchrunAnchor

ANCHOR = os.path.join(BENCH_DIR, "_dtensor_train_gpt.py")
STATS = {"best": max, "median": statistics.median}  # over the rounds' tokens/s
LOSS_RTOL = 1e-3  # every side trains the same model on the same batches: losses agree closely


class PlainSide:
    """The unsharded model in this process."""

    def __init__(self, args):
        self.ex = _gpt.load_example()
        self.args = args
        self.model = self.ex.build_model(_gpt.config(args), args.seed)
        self.opt = self.ex.make_optimizer(self.model, args.lr)
        self.data = self.ex.load_corpus()
        self.losses: list = []
        self.run(args.warmup)

    def run(self, n: int) -> None:
        a = self.args
        for _ in range(n):
            tokens, targets = self.ex.get_batch(self.data, len(self.losses), a.batch, a.seq_len, a.seed)
            self.losses.append(self.ex.train_step(self.model, self.opt, tokens, targets).detach())

    def round(self) -> float:
        gc.collect()
        t0 = time.perf_counter()
        self.run(self.args.steps)
        return time.perf_counter() - t0

    def loss_values(self) -> list[float]:
        return [v.item() for v in self.losses]

    def close(self) -> None:
        pass


class DtorchSide:
    """The model on a (dp, tp) mesh of ``runner``'s devices, driven from this process.

    Its session is detached (bench/_remote.py) and made current only while this side runs, so
    the remote and the process runner can train side by side.
    """

    def __init__(self, args, runner: str):
        import dtorch_core as dt

        self.ex = _gpt.load_example()
        self.args = args
        self.bench = BenchSession(runner, args.dp * args.tp)
        self.session = self.bench.session
        with self.bench.current():
            mesh = dt.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
            dt.manual_seed(args.seed)
            self.model = self.ex.distribute(self.ex.build_model(_gpt.config(args), args.seed), mesh)
            self.opt = self.ex.make_optimizer(self.model, args.lr, replayable=args.compile)
            self.step = self.ex.make_step(self.model, self.opt, mesh, compile=args.compile)
        self.data = self.ex.load_corpus()
        self.losses: list = []
        self.run(args.warmup)  # plan-cache misses (and with --compile, the capture) happen here
        self.session.synchronize()

    def run(self, n: int) -> None:
        a = self.args
        with self.bench.current():  # the step distributes its batch on the current session
            for _ in range(n):
                tokens, targets = self.ex.get_batch(self.data, len(self.losses), a.batch, a.seq_len, a.seed)
                # not read here: the controller runs ahead of the workers
                self.losses.append(self.step(tokens, targets).detach())

    def round(self) -> float:
        gc.collect()
        self.session.synchronize()
        t0 = time.perf_counter()
        self.run(self.args.steps)
        self.session.synchronize()  # every worker has finished every step
        return time.perf_counter() - t0

    def loss_values(self) -> list[float]:
        return [v.full_tensor().item() for v in self.losses]

    def fallbacks(self) -> dict:
        return dict(self.session.fallback_counts)

    def close(self) -> None:
        self.losses.clear()
        self.model = self.opt = self.step = None
        self.bench.close()


def max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return float("inf")
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", default="process",
                        help="dtorch runner: process (default), thread, inline, or any registered runner name; "
                             "remote (dtorch-zmq) also trains on the process runner in the same run")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed per round and side (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side, interleaved (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, on every side (default 3)")
    parser.add_argument("--compile", action="store_true",
                        help="dtorch side: the example's step captured and replayed (dt.compile, dtorch's AdamW); "
                             "the warm-up is then at least 3 steps (a warm-up call and two recordings)")
    parser.add_argument("--stat", choices=sorted(STATS), default="best",
                        help="how rounds are summarised (default best: least disturbed by other load)")
    _gpt.add_model_options(parser)
    parser.add_argument("--json", dest="json_out", help="also write every sample and the summary to this JSON file")
    parser.add_argument("--anchor-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.runner == "remote":
        require_remote()  # before anything starts: say so at once when dtorch-zmq is missing
    if args.compile:
        args.warmup = max(args.warmup, 3)
    if args.batch % args.dp:
        parser.error(f"--batch {args.batch} must divide by --dp {args.dp} (the DTensor side splits it evenly)")

    torch.set_num_threads(1)
    import structlog

    # The bench is an entry point: keep library logs out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    world = args.dp * args.tp
    tokens_per_step = args.batch * args.seq_len
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    # The dtorch sides by key; with the remote runner the process runner trains beside it.
    sides = {"process": "process", "dtorch": "remote"} if args.runner == "remote" else {"dtorch": args.runner}
    seconds = {**{k: [] for k in sides}, "dtensor": [], "plain": []}
    anchor_argv = _gpt.model_argv(args) + ["--dp", args.dp, "--tp", args.tp, "--warmup", args.warmup,
                                           "--steps", args.steps, "--rounds", args.rounds]
    anchor = TorchrunAnchor(ANCHOR, anchor_argv, world, args.anchor_timeout)
    dtorch: dict = {}
    losses, fallbacks = {}, {}
    try:
        plain = PlainSide(args)
        n_params = sum(p.numel() for p in plain.model.parameters())
        for key, runner in sides.items():
            dtorch[key] = DtorchSide(args, runner)
        anchor.wait_ready()
        # Rounds interleave the sides, so background load on a shared machine hits all alike.
        for r in range(args.rounds):
            seconds["plain"].append(plain.round())
            for key, side in dtorch.items():
                seconds[key].append(side.round())
            seconds["dtensor"].append(anchor.run_round(r, "train")["seconds"])
        losses["plain"] = plain.loss_values()
        while dtorch:
            key, side = dtorch.popitem()
            losses[key] = side.loss_values()
            fallbacks[sides[key]] = side.fallbacks()
            side.close()
        anchor_final = anchor.finish()
        losses["dtensor"] = anchor_final["losses"]
    finally:
        for side in dtorch.values():
            side.close()
        anchor.close()
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()[0]

    tps = {k: [args.steps * tokens_per_step / s for s in v] for k, v in seconds.items()}
    stat = STATS[args.stat]
    summary = {k: stat(v) for k, v in tps.items()}
    diffs = {k: max_rel_diff(losses[k], losses["plain"]) for k in (*sides, "dtensor")}
    mode = f"dp{args.dp} x tp{args.tp}{', dt.compile' if args.compile else ''}"
    labels = {
        **{k: f"dtorch ({runner} runner, {mode})" for k, runner in sides.items()},
        "dtensor": f"DTensor (torchrun x{world}, gloo, dp{args.dp} x tp{args.tp})",
        "plain": "plain torch (1 process, 1 device)",
    }
    names = {**sides, "dtensor": "DTensor"}

    print(f"dtorch train_gpt bench: examples/train_gpt.py's GPT, {n_params / 1e6:.2f}M params "
          f"(d_model {args.d_model}, {args.layers} layers, {args.heads} heads), seq {args.seq_len}, "
          f"global batch {args.batch} ({tokens_per_step} tokens/step), AdamW")
    print(f"{world} CPU devices as dp{args.dp} x tp{args.tp}; {args.steps} timed steps per round, {args.rounds} "
          f"interleaved rounds, {args.warmup} warm-up steps first, {args.stat} round reported")
    print(f"threads: OMP_NUM_THREADS=1 and torch.set_num_threads(1) in this process, the dtorch workers and "
          f"every torchrun rank (torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs)")
    if "remote" in sides.values():
        print(f"remote workers: `dtorch worker` x{world} on 127.0.0.1 (launcher mode), nice "
              f"{worker_nice(world)} like the process runner's workers")
    ok = {k: d <= LOSS_RTOL for k, d in diffs.items()}
    print(f"losses of all {len(losses['plain'])} steps vs plain torch: "
          + ", ".join(f"{names[k]} max rel diff {d:.1e} ({'ok' if ok[k] else 'MISMATCH'})" for k, d in diffs.items())
          + "; dtorch fallbacks: " + ", ".join(f"{r} {f or 'none'}" for r, f in fallbacks.items()))
    busy = max(load_before, load_after) > 0.5 * (os.cpu_count() or 1)
    print(f"load average before/after: {load_before:.2f}/{load_after:.2f}"
          + ("  (machine busy: numbers are inflated and noisy; compare ratios, rerun when idle)" if busy else ""))
    print()
    w = max(len(v) for v in labels.values()) + 2
    print(" " * w + f"{'tokens/s':>10}{'ms/step':>9}{'x DTensor':>11}{'x plain':>9}   rounds (tokens/s)")
    for k, label in labels.items():
        spread = " ".join(f"{v:.0f}" for v in tps[k])
        print(f"{label:<{w}}{summary[k]:>10.0f}{1e3 * tokens_per_step / summary[k]:>9.1f}"
              f"{summary[k] / summary['dtensor']:>11.2f}{summary[k] / summary['plain']:>9.2f}   {spread}")
    print()
    ratio = summary["dtorch"] / summary["dtensor"]
    # step time is tokens per step / tokens/s: remote's over process's is process tokens/s over remote's
    step_ratio = summary["process"] / summary["dtorch"] if "process" in sides else None
    print(f"bench wall time {elapsed:.1f}s")
    print(f"ratio dtorch/dtensor tokens/s = {ratio:.2f} (target >= 1.0)")
    if step_ratio is not None:
        print(f"ratio remote/process step time = {step_ratio:.2f}")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({
                "config": {**{k: v for k, v in vars(args).items() if k != "json_out"}, "sides": sides, "world_size": world,
                           "params": n_params, "torch": torch.__version__, "python": platform.python_version(),
                           "cpus": os.cpu_count(), "load_average_before": load_before,
                           "load_average_after": load_after},
                "labels": labels,
                "tokens_per_s": summary,
                "samples_tokens_per_s": tps,
                "losses": losses,
                "loss_max_rel_diff_vs_plain": diffs,
                "dtorch_fallbacks": fallbacks,
                "dtensor_env": {k: v for k, v in anchor_final.items() if k not in ("losses", "samples")},
                "ratio_dtorch_over_dtensor": ratio,
                "ratio_remote_over_process_step_time": step_ratio,
                "wall_time_s": elapsed,
            }, f, indent=2)
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
