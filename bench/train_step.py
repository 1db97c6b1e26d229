"""Step time of a tensor-parallel GPT training step: dtorch replay (dt.compile) and eager against
PyTorch DTensor and plain torch, measured in one run.

    python bench/train_step.py [--runner process|thread] [--steps 5] [--rounds 3] [--json out.json] [--profile]

Sides (see bench/README.md), all training examples/train_gpt.py's GPT from the same seed on the
same batches in the same order:
  dtorch replay  the example's ``train_step`` under ``dt.compile``: after its warm-up and two
                 recorded calls, each call sends one RunProgram; dt.optim.AdamW
  dtorch eager   the same ``train_step`` called directly (the controller issues every op)
  DTensor        torch.distributed.tensor.parallel with the same plan under
                 ``torchrun --nproc_per_node <world>`` (gloo, 127.0.0.1), torch.optim.AdamW
  plain torch    the unsharded model in this process, torch.optim.AdamW
Tensor parallel only, over a 1-D mesh of ``--world-size`` CPU devices (default 2). Each step is
timed on its own and ends with ``dt.synchronize()`` (DTensor: a barrier), so a step's time is
the time until every device has finished it; the dtorch sides' steps include distributing the
batch (``dt.distribute_tensor``). The median step (or ``--stat min``) of all timed steps is
reported, with its ratio to DTensor's from the same run. The last lines are the headlines
``ratio replay/dtensor`` (target <= 1.0) and ``ratio eager/replay`` (target >= 3).
"""

from __future__ import annotations

import os

# Fairness: one intra-op thread everywhere (this process, the dtorch workers and the torchrun
# ranks). Set before torch is imported so OpenMP picks it up.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("DTORCH_WORKER_THREADS", "1")
# The torchrun ranks run at the default priority; so do the dtorch workers here (the process
# runner renices them to 19 on a machine with no more cores than workers, which on a shared
# machine hands their time to everyone else's processes). DTORCH_WORKER_NICE=19 measures that.
os.environ.setdefault("DTORCH_WORKER_NICE", "0")

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)

import _gpt  # noqa: E402  (puts the repository root on sys.path too)
from _torchrun import TorchrunAnchor  # noqa: E402

ANCHOR = os.path.join(BENCH_DIR, "_dtensor_train_step.py")
STATS = {"min": min, "median": statistics.median}
LOSS_RTOL = 1e-3  # every side trains the same model on the same batches: losses agree closely
REPLAY_AFTER = 3  # dt.compile: one warm-up call and two recorded ones, then replays


def batches_for(ex, args, n: int) -> list:
    """The (tokens, targets) of steps 0..n-1, made up front (data loading is not timed)."""
    data = ex.load_corpus()
    return [ex.get_batch(data, i, args.batch, args.seq_len, args.seed) for i in range(n)]


class PlainSide:
    """The unsharded model in this process with torch.optim.AdamW."""

    def __init__(self, ex, args, batches):
        self.ex = ex
        self.batches = batches
        self.model = ex.build_model(_gpt.config(args), args.seed)
        self.opt = ex.make_optimizer(self.model, args.lr)
        self.losses: list = []
        for _ in range(args.warmup):
            self.step()

    def step(self) -> None:
        tokens, targets = self.batches[len(self.losses)]
        self.losses.append(self.ex.train_step(self.model, self.opt, tokens, targets).detach())

    def round(self, steps: int) -> list[float]:
        gc.collect()
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step()
            out.append(time.perf_counter() - t0)
        return out

    def loss_values(self) -> list[float]:
        return [v.item() for v in self.losses]


class DtorchModel:
    """One copy of the model on the tp mesh with dt.optim.AdamW, stepped by ``fn``.

    ``fn`` is the example's ``train_step`` itself (eager) or ``dt.compile`` of it (replay).
    Every step records its phases: distributing the batch, the call (the controller's own time:
    the call returns without waiting for the workers), and the wait in ``dt.synchronize()``.
    """

    def __init__(self, dt, ex, args, mesh, batches, fn):
        self.dt = dt
        self.mesh = mesh
        self.batches = batches
        self.fn = fn
        self.model = dt.nn.parallelize_module(ex.build_model(_gpt.config(args), args.seed), mesh, ex.tp_plan())
        # the example's AdamW hyper-parameters, in the optimizer that keeps its step count on the workers
        hyper = ex.make_optimizer(torch.nn.Linear(1, 1), args.lr).defaults
        self.opt = dt.optim.AdamW(self.model.parameters(), lr=hyper["lr"], betas=hyper["betas"],
                                  eps=hyper["eps"], weight_decay=hyper["weight_decay"])
        self.losses: list = []
        self.phases: dict = {"distribute": [], "call": [], "wait": []}
        for _ in range(args.warmup):
            self.step()
        dt.synchronize()

    def step(self) -> float:
        dt = self.dt
        tokens, targets = self.batches[len(self.losses)]
        replicate = [dt.Replicate()] * self.mesh.ndim
        t0 = time.perf_counter()
        x = dt.distribute_tensor(tokens, self.mesh, replicate)
        y = dt.distribute_tensor(targets, self.mesh, replicate)
        t1 = time.perf_counter()
        loss = self.fn(self.model, self.opt, x, y)
        t2 = time.perf_counter()
        dt.synchronize()
        t3 = time.perf_counter()
        self.losses.append(loss)
        self.phases["distribute"].append(t1 - t0)
        self.phases["call"].append(t2 - t1)
        self.phases["wait"].append(t3 - t2)
        return t3 - t0

    def round(self, steps: int) -> list[float]:
        gc.collect()
        self.dt.synchronize()
        return [self.step() for _ in range(steps)]

    def loss_values(self) -> list[float]:
        return [v.full_tensor().item() for v in self.losses]


class DtorchSide:
    """One dtorch session; an eager and a replayed copy of the model (same seed, same batches)."""

    def __init__(self, ex, args, batches):
        import dtorch_core as dt

        self.dt = dt
        dt.init(world_size=args.world_size, runner=args.runner)
        self.runner = args.runner
        self.mesh = dt.init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("tp",))
        dt.manual_seed(args.seed)
        self.compiled = dt.compile(ex.train_step)
        self.eager = DtorchModel(dt, ex, args, self.mesh, batches, ex.train_step)
        self.replay = DtorchModel(dt, ex, args, self.mesh, batches, self.compiled)
        self.replays_after_warmup = self.compiled.replays

    def program(self):
        (entry,) = [e for e in self.compiled._captured.values() if e.program is not None]
        return entry.program

    def instruction_counts(self) -> tuple[dict, dict]:
        """(recorded instructions by kind, the replayed program's instructions by type)."""
        program = self.program()
        recorded = collections.Counter(entry[0] for entry in program.signature)
        replayed = collections.Counter(type(ins).__name__ for ins in program.instructions)
        return dict(recorded), dict(replayed)

    def close(self) -> None:
        self.eager = self.replay = None
        self.dt.shutdown()


def max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return float("inf")
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))


def profile_controller(side: DtorchSide, steps: int, top: int) -> str:
    """cProfile of the controller's own part of ``steps`` replayed steps: the call alone.

    The batch is distributed and every worker is idle before each call, and the profiler stops
    before ``dt.synchronize()``, so the profile holds what one replay costs the controller and
    nothing of the workers' time.
    """
    import cProfile
    import pstats

    dt, mesh, model = side.dt, side.mesh, side.replay
    replicate = [dt.Replicate()] * mesh.ndim
    tokens, targets = model.batches[0]
    prof = cProfile.Profile()
    for _ in range(steps):
        x = dt.distribute_tensor(tokens, mesh, replicate)
        y = dt.distribute_tensor(targets, mesh, replicate)
        dt.synchronize()
        prof.enable()
        side.compiled(model.model, model.opt, x, y)
        prof.disable()
        dt.synchronize()
    return format_profile(pstats.Stats(prof), steps, top, side.runner)


def format_profile(stats, calls: int, top: int, runner: str) -> str:
    """The ``top`` functions by own time, in microseconds per replay call (pstats prints ms)."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.stats.values())
    note = ("; calls into the native channel are not seen by cProfile, their time counts as their caller's own "
            "(ProcessRunner.submit)" if runner == "process" else "")
    lines = [f"controller profile of {calls} replay calls (cProfile; its own overhead inflates every row): "
             f"{total / calls * 1e6:.0f} us per call in all{note}",
             f"{'own us/call':>12}{'cum us/call':>12}{'calls/call':>11}  function"]
    for (file, line, name), (_, ncalls, own, cum, _) in rows:
        path = os.path.relpath(file, REPO_ROOT) if file.startswith(REPO_ROOT) else os.path.basename(file)
        where = name if file == "~" else f"{path}:{line}({name})"
        lines.append(f"{own / calls * 1e6:>12.1f}{cum / calls * 1e6:>12.1f}{ncalls / calls:>11.1f}  {where}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", default="process",
                        help="dtorch runner: process (default), thread, inline, or any registered runner name")
    parser.add_argument("--world-size", type=int, default=2, help="tp size: dtorch devices = torchrun ranks (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and side (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side, interleaved (default 3)")
    parser.add_argument("--warmup", type=int, default=REPLAY_AFTER,
                        help=f"untimed steps first, on every side (default and minimum {REPLAY_AFTER}: "
                             "dt.compile replays from its 4th call)")
    parser.add_argument("--stat", choices=sorted(STATS), default="median",
                        help="how the timed steps are summarised (default median)")
    _gpt.add_model_options(parser)
    parser.set_defaults(d_model=256, batch=8)  # the model of issue 4
    parser.add_argument("--json", dest="json_out", help="also write every sample and the summary to this JSON file")
    parser.add_argument("--profile", action="store_true",
                        help="afterwards, cProfile the controller's replay calls (the call alone, workers idle)")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--anchor-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.warmup < REPLAY_AFTER:
        parser.error(f"--warmup must be at least {REPLAY_AFTER}: dt.compile replays from its 4th call")

    torch.set_num_threads(1)
    import structlog

    # The bench is an entry point: keep library logs out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    ex = _gpt.load_example()
    world = args.world_size
    n_steps = args.warmup + args.rounds * args.steps
    batches = batches_for(ex, args, n_steps)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    samples = {"replay": [], "eager": [], "dtensor": [], "plain": []}
    anchor_argv = _gpt.model_argv(args) + ["--warmup", args.warmup, "--steps", args.steps, "--rounds", args.rounds]
    anchor = TorchrunAnchor(ANCHOR, anchor_argv, world, args.anchor_timeout)
    dtorch = None
    profile_text = None
    try:
        plain = PlainSide(ex, args, batches)
        n_params = sum(p.numel() for p in plain.model.parameters())
        dtorch = DtorchSide(ex, args, batches)
        anchor.wait_ready()
        # Rounds interleave the sides, so background load on a shared machine hits all alike.
        for r in range(args.rounds):
            samples["plain"] += plain.round(args.steps)
            samples["eager"] += dtorch.eager.round(args.steps)
            samples["replay"] += dtorch.replay.round(args.steps)
            samples["dtensor"] += anchor.run_round(r, "train")["step_seconds"]
        replays = dtorch.compiled.replays - dtorch.replays_after_warmup
        program = dtorch.program()
        rec_counts, counts = dtorch.instruction_counts()
        phases = {"eager": dtorch.eager.phases, "replay": dtorch.replay.phases}
        for per in phases.values():  # the timed steps only
            for k in per:
                per[k] = per[k][args.warmup:]
        losses = {"plain": plain.loss_values(), "eager": dtorch.eager.loss_values(),
                  "replay": dtorch.replay.loss_values()}
        fallbacks = dtorch.dt.fallback_counts()
        if args.profile:
            profile_text = profile_controller(dtorch, args.rounds * args.steps, args.profile_top)
        dtorch.close()
        dtorch = None
        anchor_final = anchor.finish()
        losses["dtensor"] = anchor_final["losses"]
    finally:
        if dtorch is not None:
            dtorch.close()
        anchor.close()
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()[0]

    stat = STATS[args.stat]
    ms = {k: stat(v) * 1e3 for k, v in samples.items()}
    phase_ms = {side: {k: stat(v) * 1e3 for k, v in per.items()} for side, per in phases.items()}
    diffs = {k: max_rel_diff(losses[k], losses["plain"]) for k in ("eager", "replay", "dtensor")}
    ok = {k: d <= LOSS_RTOL for k, d in diffs.items()}
    recorded = program.recorded
    ctrl_us_per_op = {k: phase_ms[k]["call"] * 1e3 / recorded for k in phase_ms}
    labels = {
        "replay": f"dtorch replay ({args.runner} runner, dt.compile)",
        "eager": f"dtorch eager ({args.runner} runner)",
        "dtensor": f"DTensor (torchrun x{world}, gloo)",
        "plain": "plain torch (1 process, unsharded)",
    }

    print(f"dtorch train_step bench: examples/train_gpt.py's GPT, {n_params / 1e6:.2f}M params (d_model "
          f"{args.d_model}, {args.layers} layers, {args.heads} heads, vocab {ex.VOCAB}), seq {args.seq_len}, batch "
          f"{args.batch}; tensor parallel over {world} CPU devices; AdamW (dtorch: dt.optim.AdamW, "
          "others: torch.optim.AdamW)")
    print(f"{args.steps} timed steps per round, {args.rounds} interleaved rounds, {args.warmup} warm-up steps "
          f"first; each step timed alone, ending with dt.synchronize() (DTensor: a barrier); {args.stat} step "
          "reported")
    print(f"threads: OMP_NUM_THREADS=1 and torch.set_num_threads(1) in this process, the dtorch workers and every "
          f"torchrun rank (torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"dtorch workers' nice {os.environ.get('DTORCH_WORKER_NICE')})")
    print(f"losses of all {len(losses['plain'])} steps vs plain torch (max rel diff): "
          + ", ".join(f"{k} {diffs[k]:.1e} ({'ok' if ok[k] else 'MISMATCH'})" for k in diffs)
          + f"; dtorch fallbacks: {fallbacks or 'none'}")
    print(f"captured step: {recorded} instructions recorded ({rec_counts.get('call', 0)} calls, "
          f"{rec_counts.get('collective', 0)} collectives, {rec_counts.get('put', 0)} puts); replayed as "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
          + f" ({program.eliminated} eliminated); {replays} replays timed"
          + ("" if replays == args.rounds * args.steps else "  (EXPECTED EVERY TIMED STEP TO REPLAY)"))
    busy = max(load_before, load_after) > 0.5 * (os.cpu_count() or 1)
    print(f"load average before/after: {load_before:.2f}/{load_after:.2f}"
          + ("  (machine busy: numbers are inflated and noisy; compare ratios, rerun when idle)" if busy else ""))
    print()
    w = max(len(v) for v in labels.values()) + 2
    print(" " * w + f"{'step ms':>9}{'x DTensor':>11}{'x plain':>9}   {'min-max ms':>13}")
    for k in ("replay", "eager", "dtensor", "plain"):
        spread = f"{min(samples[k]) * 1e3:.0f}-{max(samples[k]) * 1e3:.0f}"
        print(f"{labels[k]:<{w}}{ms[k]:>9.1f}{ms[k] / ms['dtensor']:>11.2f}{ms[k] / ms['plain']:>9.2f}   {spread:>13}")
    print()
    print(f"dtorch step phases ({args.stat} ms): " + "; ".join(
        f"{k}: distribute {p['distribute']:.2f}, call {p['call']:.2f}, wait in synchronize {p['wait']:.1f}"
        for k, p in phase_ms.items()))
    print(f"controller per replay call: {phase_ms['replay']['call'] * 1e3:.0f} us for {recorded} ops = "
          f"{ctrl_us_per_op['replay'] * 1e3:.1f} ns/op ({ctrl_us_per_op['replay'] / ctrl_us_per_op['eager']:.4f}x "
          f"eager's {ctrl_us_per_op['eager']:.1f} us/op)")
    print(f"bench wall time {elapsed:.1f}s")
    ratio_replay = ms["replay"] / ms["dtensor"]
    ratio_eager = ms["eager"] / ms["replay"]
    print(f"ratio replay/dtensor = {ratio_replay:.2f} (target <= 1.0)")
    print(f"ratio eager/replay = {ratio_eager:.2f} (target >= 3)")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({
                "config": {**{k: v for k, v in vars(args).items() if k != "json_out"}, "params": n_params,
                           "torch": torch.__version__, "python": platform.python_version(),
                           "cpus": os.cpu_count(), "load_average_before": load_before,
                           "load_average_after": load_after,
                           "dtorch_worker_nice": os.environ.get("DTORCH_WORKER_NICE")},
                "labels": labels,
                "step_ms": ms,
                "samples_step_s": samples,
                "dtorch_phases_ms": phase_ms,
                "dtorch_phase_samples_s": phases,
                "program": {"recorded": recorded, "recorded_by_kind": rec_counts, "eliminated": program.eliminated,
                            "replayed_instructions": counts},
                "controller_us_per_op": ctrl_us_per_op,
                "losses": losses,
                "loss_max_rel_diff_vs_plain": diffs,
                "dtorch_fallbacks": fallbacks,
                "dtensor_env": {k: v for k, v in anchor_final.items() if k not in ("losses", "samples")},
                "ratio_replay_over_dtensor": ratio_replay,
                "ratio_eager_over_replay": ratio_eager,
                "wall_time_s": elapsed,
            }, f, indent=2)
    if profile_text:
        print()
        print(profile_text)
    return 0 if all(ok.values()) and replays == args.rounds * args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
