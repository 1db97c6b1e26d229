"""Per-op dispatch cost of dtorch against PyTorch DTensor and plain torch, measured in one run.

    python bench/dispatch.py [--ops 10000] [--runner thread] [--json out.json] [--profile]
    python bench/dispatch.py --runner remote   # remote (dtorch-zmq) and process runners, side by side

Rows (see bench/README.md for what each one means):
  dtorch controller   time for the controller to issue the ops (no final synchronize) / ops
  dtorch end-to-end   same, including dt.synchronize() (workers ran everything) / ops
  DTensor             torch.distributed.tensor under torchrun (gloo, 127.0.0.1), rank 0 / ops
  plain torch         the same ops on local 64x64 tensors in this process / ops
Every number is printed with its ratio to DTensor measured in the same run; the last line is the
headline ``ratio dtorch_controller/dtensor`` for the ``add`` stream.

``--runner remote`` (the dtorch-zmq plugin; ``dtorch worker`` processes on 127.0.0.1, launcher
mode) also measures the process runner in the same run, its rounds interleaved with the others,
and ends with the headline ``ratio remote/process controller`` (issue 16's target: <= 1.2).
"""

from __future__ import annotations

import os

# Fairness: one intra-op thread everywhere (this process, its worker threads and the torchrun
# ranks). Set before torch is imported so OpenMP picks it up.
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import contextlib
import gc
import json
import logging
import platform
import statistics
import sys
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)  # run from a checkout without installing dtorch-core

import _streams
from _remote import BenchSession, require_remote, worker_nice
from _torchrun import TorchrunAnchor

ANCHOR = os.path.join(BENCH_DIR, "_dtensor_anchor.py")


STATS = {"min": min, "median": statistics.median}
# A dtorch side's rows, keyed by its prefix: "dtorch" for --runner, "process" for the process
# runner measured beside the remote one.
SIDE_ROWS = (("controller", "dtorch controller ({runner})"), ("end_to_end", "dtorch end-to-end ({runner})"))
PAUSED_ROW = ("controller_workers_paused", "  diag: dtorch controller ({runner}), workers paused")
ANCHOR_ROWS = (("dtensor", "DTensor (torchrun x{world}, gloo, rank 0)"),
               ("plain_torch", "plain torch (local 64x64, 1 process)"))
TARGET_REMOTE_OVER_PROCESS = 1.2  # issue 16: the remote runner's controller cost per op
TARGET_CONTROLLER_OVER_DTENSOR = 0.5  # issue 18: the controller's cost per op, with the native hot path


def row_labels(sides: dict, world: int) -> dict:
    """{key: label} in table order: every dtorch side's rows, the anchors, the diagnostics."""
    labels = {}
    for prefix, runner in sides.items():
        labels.update({f"{prefix}_{key}": label.format(runner=runner) for key, label in SIDE_ROWS})
    labels.update({key: label.format(world=world) for key, label in ANCHOR_ROWS})
    for prefix, runner in sides.items():
        labels[f"{prefix}_{PAUSED_ROW[0]}"] = PAUSED_ROW[1].format(runner=runner)
    return labels


# ---------------------------------------------------------------------------------------------
# one timed round per side (rounds of all sides interleave, see main)
# ---------------------------------------------------------------------------------------------
def _steps(stream: str, ops: int) -> tuple:
    step, per = _streams.STREAMS[stream]
    steps = max(1, ops // per)
    return step, steps, steps * per


class PlainSide:
    """Plain torch on the local shard shape, in this process (the second anchor)."""

    def __init__(self, warmup: int):
        self.a, self.b = _streams.local_inputs()
        for step, per in _streams.STREAMS.values():
            for _ in range(max(1, warmup // per)):
                step(self.a, self.b)

    def round(self, stream: str, ops: int) -> float:
        step, steps, n = _steps(stream, ops)
        a, b = self.a, self.b
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(a, b)
        return (time.perf_counter() - t0) / n * 1e6


class DtorchSide:
    """dtorch on ``runner``: a global (64 * world, 64) tensor, Shard(0), one session for all rounds.

    The session is detached (bench/_remote.py), so two sides (remote and process) live at once;
    the ops reach it through the tensors' handles.
    """

    def __init__(self, runner: str, world: int, warmup: int):
        import dtorch_core as dt

        self.bench = BenchSession(runner, world)
        self.session = self.bench.session
        with self.bench.current():
            mesh = dt.init_device_mesh("cpu", (world,))
            self.a_full, self.b_full = _streams.global_inputs(world)
            self.a = dt.distribute_tensor(self.a_full, mesh, [dt.Shard(0)])
            self.b = dt.distribute_tensor(self.b_full, mesh, [dt.Shard(0)])
        for step, per in _streams.STREAMS.values():
            for _ in range(max(1, warmup // per)):  # plan-cache misses happen here
                step(self.a, self.b)
        self.session.synchronize()

    def round(self, stream: str, ops: int) -> tuple[float, float]:
        """(controller us/op, end-to-end us/op) for one pass of ``ops`` ops."""
        step, steps, n = _steps(stream, ops)
        a, b = self.a, self.b
        gc.collect()
        self.session.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(a, b)
        t1 = time.perf_counter()
        self.session.synchronize()
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

    def round_workers_paused(self, stream: str, ops: int) -> float:
        """Issue time with batches held back from the workers, so no worker competes for the GIL.

        A diagnostic only: it separates the controller's own Python cost from the contention
        the thread runner's workers add. The held batches are submitted afterwards, in order.
        """
        step, steps, n = _steps(stream, ops)
        a, b = self.a, self.b
        gc.collect()
        self.session.synchronize()
        with self.workers_paused():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(a, b)
            elapsed = time.perf_counter() - t0
        self.session.synchronize()
        return elapsed / n * 1e6

    @contextlib.contextmanager
    def workers_paused(self):
        """Hold every batch the session submits; on exit submit them in order."""
        session = self.session
        runner = session.runner
        held: list = []
        runner.submit = held.append  # an instance attribute shadows the method
        try:
            yield
        finally:
            # Under the session's lock, so the background flusher cannot slip a newer batch
            # (e.g. a Delete) in ahead of the held ones.
            with getattr(session, "_lock", contextlib.nullcontext()):
                session.flush()
                del runner.submit
                for batch in held:
                    runner.submit(batch)

    def values_ok(self) -> bool:
        step = _streams.STREAMS["mix"][0]
        return bool(torch.allclose(step(self.a, self.b).full_tensor(), step(self.a_full, self.b_full)))

    def close(self) -> None:
        self.a = self.b = None
        self.bench.close()


def profile_dtorch(runner: str, world: int, ops: int, warmup: int, top: int) -> str:
    """cProfile of the controller issuing ``a + a`` with the workers paused (its own cost only).

    The contention with the thread runner's workers is left out on purpose: cProfile would
    charge GIL waits to whatever line happened to be running. The table's gap between
    ``dtorch controller`` and the workers-paused row measures that part.
    """
    import cProfile
    import io
    import pstats

    side = DtorchSide(runner, world, warmup)
    try:
        a = side.a
        side.session.synchronize()
        prof = cProfile.Profile()
        with side.workers_paused():
            prof.enable()
            for _ in range(ops):
                a + a
            prof.disable()
        side.session.synchronize()
    finally:
        side.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# PyTorch DTensor anchor (torchrun subprocess on 127.0.0.1, driven round by round)
# ---------------------------------------------------------------------------------------------
class DTensorAnchor(TorchrunAnchor):
    """``torchrun --nproc_per_node world bench/_dtensor_anchor.py`` (see bench/_torchrun.py).

    It starts at once (its start-up overlaps ours), warms up, then runs one timed round each
    time ``round`` asks for it, so its rounds interleave with the other sides'.
    """

    def __init__(self, world: int, ops: int, rounds: int, warmup: int, timeout: float):
        super().__init__(ANCHOR, ["--ops", ops, "--rounds", rounds, "--warmup", warmup], world, timeout)

    def round(self, r: int, stream: str) -> float:
        return self.run_round(r, stream)["us_per_op"]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def format_table(summary: dict, labels: dict) -> str:
    names = list(_streams.STREAMS)
    titles = {"add": "add", "mix": "mix (add/mul/relu)"}
    w = max(len(v) for v in labels.values()) + 2
    lines = [
        " " * w + "".join(f"{titles.get(s, s):>22}" for s in names),
        " " * w + "".join(f"{'us/op':>11}{'x DTensor':>11}" for _ in names),
    ]
    for key, label in labels.items():
        cells = ""
        for s in names:
            v = summary[key][s]
            cells += f"{v:>11.2f}{v / summary['dtensor'][s]:>11.2f}"
        lines.append(f"{label:<{w}}{cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=10_000, help="ops timed per stream and round (default 10000)")
    parser.add_argument("--runner", default="thread",
                        help="dtorch runner: thread (default), inline, or any registered runner name; remote "
                             "(dtorch-zmq) also measures the process runner in the same run")
    parser.add_argument("--world-size", type=int, default=2, help="dtorch devices = torchrun ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side, interleaved (default 5)")
    parser.add_argument("--stat", choices=sorted(STATS), default="min",
                        help="how rounds are summarised (default min: least disturbed by other load)")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up ops per stream before timing (default 300)")
    parser.add_argument("--json", dest="json_out", help="also write every sample and summary to this JSON file")
    parser.add_argument("--profile", action="store_true", help="afterwards, cProfile the dtorch controller on a + a (workers paused)")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--anchor-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.runner == "remote":
        require_remote()  # before anything starts: say so at once when dtorch-zmq is missing

    torch.set_num_threads(1)
    import structlog

    # The bench is an entry point: keep library debug logs out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    world = args.world_size
    streams = list(_streams.STREAMS)
    # The dtorch sides by row prefix; with the remote runner the process runner is measured beside it.
    sides = {"process": "process", "dtorch": "remote"} if args.runner == "remote" else {"dtorch": args.runner}
    labels = row_labels(sides, world)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    samples = {key: {s: [] for s in streams} for key in labels}
    anchor = DTensorAnchor(world, args.ops, args.rounds, args.warmup, args.anchor_timeout)
    dtorch: dict = {}
    values_ok = {}
    try:
        plain = PlainSide(args.warmup)
        for prefix, runner in sides.items():
            dtorch[prefix] = DtorchSide(runner, world, args.warmup)
        anchor.wait_ready()
        # Rounds interleave the sides, so background load on a shared machine hits all alike.
        for r in range(args.rounds):
            for s in streams:
                samples["plain_torch"][s].append(plain.round(s, args.ops))
                for prefix, side in dtorch.items():
                    ctrl, e2e = side.round(s, args.ops)
                    samples[f"{prefix}_controller"][s].append(ctrl)
                    samples[f"{prefix}_end_to_end"][s].append(e2e)
                    samples[f"{prefix}_controller_workers_paused"][s].append(side.round_workers_paused(s, args.ops))
                samples["dtensor"][s].append(anchor.round(r, s))
        while dtorch:
            prefix, side = dtorch.popitem()
            values_ok[sides[prefix]] = side.values_ok()
            side.close()
        anchor_final = anchor.finish()
    finally:
        for side in dtorch.values():
            side.close()
        anchor.close()
    values_ok["DTensor"] = anchor_final["values_ok"]
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()[0]

    stat = STATS[args.stat]
    summary = {key: {s: stat(v) for s, v in per.items()} for key, per in samples.items()}
    ratio = summary["dtorch_controller"]["add"] / summary["dtensor"]["add"]
    ratio_mix = summary["dtorch_controller"]["mix"] / summary["dtensor"]["mix"]

    print(f"dtorch dispatch bench: world {world}, dtorch runner(s) {', '.join(repr(r) for r in sides.values())}, "
          f"{args.ops} ops per stream and round, {args.rounds} interleaved rounds, {args.stat} reported, "
          f"{args.warmup} warm-up ops first")
    print(f"shapes: global ({_streams.SHARD_ROWS * world}, {_streams.COLS}) float32 with [Shard(0)] -> "
          f"{_streams.SHARD_ROWS}x{_streams.COLS} shards; plain torch on local {_streams.SHARD_ROWS}x{_streams.COLS}")
    print(f"threads: OMP_NUM_THREADS=1 and torch.set_num_threads(1) in this process and in every torchrun rank "
          f"(torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs)")
    if "remote" in sides.values():
        print(f"remote workers: `dtorch worker` x{world} on 127.0.0.1 (launcher mode), nice "
              f"{worker_nice(world)} like the process runner's workers")
    from dtorch_core.planner import native_dispatch

    print(f"controller hot path: {native_dispatch.active()}")
    print("values checked against torch: " + ", ".join(f"{k} {v}" for k, v in values_ok.items()))
    busy = max(load_before, load_after) > 0.5 * (os.cpu_count() or 1)
    print(f"load average before/after: {load_before:.2f}/{load_after:.2f}"
          + ("  (machine busy: numbers are inflated and noisy; compare ratios, rerun when idle)" if busy else ""))
    print()
    print(format_table(summary, labels))
    print()
    for key in ("process_controller", "dtorch_controller", "dtensor"):
        if key in samples:
            spread = "  ".join(f"{s} {min(samples[key][s]):.1f}-{max(samples[key][s]):.1f}" for s in streams)
            print(f"spread over rounds (us/op), {labels[key].strip()}: {spread}")
    remote_ratios = remote_over_process(summary) if "process" in sides else None
    if remote_ratios:
        print()
        for key, per in remote_ratios.items():
            print(f"ratio remote/process, {RATIO_ROWS[key]:<28}" + "  ".join(f"{s} {per[s]:.2f}" for s in streams))
    print(f"ratio dtorch_controller/dtensor (mix) = {ratio_mix:.2f}")
    print(f"bench wall time {elapsed:.1f}s")
    print(f"ratio dtorch_controller/dtensor = {ratio:.2f} (target <= {TARGET_CONTROLLER_OVER_DTENSOR})")
    if remote_ratios:
        print(f"ratio remote/process controller = {remote_ratios['controller']['add']:.2f} "
              f"(target <= {TARGET_REMOTE_OVER_PROCESS})")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "config": {
                        "ops": args.ops, "rounds": args.rounds, "stat": args.stat, "warmup": args.warmup,
                        "runner": args.runner, "sides": sides, "world_size": world, "omp_num_threads": 1,
                        "torch_num_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_average_before": load_before, "load_average_after": load_after,
                    },
                    "labels": labels,
                    "us_per_op": summary,
                    "samples_us_per_op": samples,
                    "values_ok": values_ok,
                    "dtensor_env": {k: v for k, v in anchor_final.items() if k != "samples_us"},
                    "hot_path": native_dispatch.active(),
                    "ratio_dtorch_controller_over_dtensor": ratio,
                    "ratio_dtorch_controller_over_dtensor_mix": ratio_mix,
                    "ratio_remote_over_process": remote_ratios,
                    "wall_time_s": elapsed,
                },
                f,
                indent=2,
            )

    if args.profile:
        print()
        print(profile_dtorch(args.runner, world, args.ops, args.warmup, args.profile_top))
    return 0 if all(values_ok.values()) else 1


RATIO_ROWS = {"controller": "controller", "end_to_end": "end-to-end",
              "controller_workers_paused": "controller, workers paused"}


def remote_over_process(summary: dict) -> dict:
    """{row: {stream: remote us/op / process us/op}} for the rows both runners have."""
    return {key: {s: summary[f"dtorch_{key}"][s] / summary[f"process_{key}"][s] for s in summary["dtensor"]}
            for key in RATIO_ROWS}


if __name__ == "__main__":
    sys.exit(main())
