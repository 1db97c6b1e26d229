"""Per-op dispatch cost of dtorch against PyTorch DTensor and plain torch, measured in one run.

    python bench/dispatch.py [--ops 10000] [--runner thread] [--json out.json] [--profile]

Rows (see bench/README.md for what each one means):
  dtorch controller   time for the controller to issue the ops (no final synchronize) / ops
  dtorch end-to-end   same, including dt.synchronize() (workers ran everything) / ops
  DTensor             torch.distributed.tensor under torchrun (gloo, 127.0.0.1), rank 0 / ops
  plain torch         the same ops on local 64x64 tensors in this process / ops
Every number is printed with its ratio to DTensor measured in the same run; the last line is the
headline ``ratio dtorch_controller/dtensor`` for the ``add`` stream.
"""

from __future__ import annotations

import os

# Fairness: one intra-op thread everywhere (this process, its worker threads and the torchrun
# ranks). Set before torch is imported so OpenMP picks it up.
os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)  # run from a checkout without installing dtorch-core

import _streams  # noqa: E402

ANCHOR = os.path.join(BENCH_DIR, "_dtensor_anchor.py")


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------
# plain torch (single process, local shard shapes)
# ---------------------------------------------------------------------------------------------
def measure_plain(ops: int, repeats: int, warmup: int) -> dict:
    a, b = _streams.local_inputs()
    out = {}
    for name, (step, per) in _streams.STREAMS.items():
        steps = max(1, ops // per)
        n = steps * per
        for _ in range(max(1, warmup // per)):
            step(a, b)
        samples = []
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(a, b)
            samples.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = {"us_per_op": _median_us(samples), "samples_us": samples, "ops": n}
    return out


# ---------------------------------------------------------------------------------------------
# dtorch
# ---------------------------------------------------------------------------------------------
def measure_dtorch(runner: str, world: int, ops: int, repeats: int, warmup: int) -> dict:
    import dtorch_core as dt

    dt.init(world_size=world, runner=runner)
    try:
        mesh = dt.init_device_mesh("cpu", (world,))
        a_full, b_full = _streams.global_inputs(world)
        a = dt.distribute_tensor(a_full, mesh, [dt.Shard(0)])
        b = dt.distribute_tensor(b_full, mesh, [dt.Shard(0)])
        session = dt.api.current_session()
        out = {}
        for name, (step, per) in _streams.STREAMS.items():
            steps = max(1, ops // per)
            n = steps * per
            for _ in range(max(1, warmup // per)):  # plan-cache misses happen here
                step(a, b)
            dt.synchronize()
            ctrl, e2e, paused = [], [], []
            for _ in range(repeats):
                gc.collect()
                dt.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(a, b)
                t1 = time.perf_counter()
                dt.synchronize()
                t2 = time.perf_counter()
                ctrl.append((t1 - t0) / n * 1e6)
                e2e.append((t2 - t0) / n * 1e6)
            for _ in range(repeats):
                paused.append(_controller_with_workers_paused(dt, session, step, a, b, steps) / n * 1e6)
            out[name] = {
                "controller_us_per_op": _median_us(ctrl),
                "end_to_end_us_per_op": _median_us(e2e),
                "controller_workers_paused_us_per_op": _median_us(paused),
                "controller_samples_us": ctrl,
                "end_to_end_samples_us": e2e,
                "controller_workers_paused_samples_us": paused,
                "ops": n,
            }
        # The streams must really have computed: compare one result with torch.
        values_ok = bool(torch.allclose(_streams.STREAMS["mix"][0](a, b).full_tensor(),
                                        _streams.STREAMS["mix"][0](a_full, b_full)))
        return {"runner": runner, "world_size": world, "values_ok": values_ok, "streams": out}
    finally:
        dt.shutdown()


def _controller_with_workers_paused(dt, session, step, a, b, steps) -> float:
    """Issue time with batches held back from the workers, so no worker competes for the GIL.

    A diagnostic only: it separates the controller's own Python cost from the contention the
    thread runner's workers add. The held batches are submitted afterwards, in order.
    """
    runner = session.runner
    held = []
    gc.collect()
    dt.synchronize()
    runner.submit = held.append  # instance attribute shadows the method
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(a, b)
        elapsed = time.perf_counter() - t0
        session.flush()
    finally:
        del runner.submit
    for batch in held:
        runner.submit(batch)
    dt.synchronize()
    return elapsed


def profile_dtorch(runner: str, world: int, ops: int, top: int) -> str:
    """cProfile of the controller thread issuing ``a + a`` (after warm-up)."""
    import cProfile
    import io
    import pstats

    import dtorch_core as dt

    dt.init(world_size=world, runner=runner)
    try:
        mesh = dt.init_device_mesh("cpu", (world,))
        a_full, b_full = _streams.global_inputs(world)
        a = dt.distribute_tensor(a_full, mesh, [dt.Shard(0)])
        for _ in range(300):
            a + a
        dt.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ops):
            a + a
        prof.disable()
        dt.synchronize()
    finally:
        dt.shutdown()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# PyTorch DTensor anchor (torchrun subprocess on 127.0.0.1)
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_dtensor(world: int, ops: int, repeats: int, warmup: int, timeout: float) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on the loopback interface
    env["MASTER_ADDR"] = "127.0.0.1"
    last_error = ""
    for _attempt in range(2):  # a second try covers a port taken between probe and bind
        with tempfile.TemporaryDirectory(prefix="dtorch-bench-") as tmp:
            out_path = os.path.join(tmp, "dtensor.json")
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "1", "--nproc_per_node", str(world),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                ANCHOR, "--ops", str(ops), "--repeats", str(repeats), "--warmup", str(warmup),
                "--out", out_path,
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode == 0 and os.path.exists(out_path):
                with open(out_path) as f:
                    return json.load(f)
            last_error = f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    raise RuntimeError(f"DTensor anchor failed: {last_error}")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def build_rows(dtorch: dict, dtensor: dict, plain: dict) -> list[tuple[str, dict]]:
    names = list(_streams.STREAMS)
    d = dtorch["streams"]
    rows = [
        (f"dtorch controller ({dtorch['runner']})", {s: d[s]["controller_us_per_op"] for s in names}),
        (f"dtorch end-to-end ({dtorch['runner']})", {s: d[s]["end_to_end_us_per_op"] for s in names}),
        (f"DTensor (torchrun x{dtensor['world_size']}, {dtensor['backend']}, rank 0)",
         {s: dtensor["streams"][s]["us_per_op"] for s in names}),
        ("plain torch (local 64x64)", {s: plain[s]["us_per_op"] for s in names}),
        ("  diag: dtorch controller, workers paused",
         {s: d[s]["controller_workers_paused_us_per_op"] for s in names}),
    ]
    return rows


def format_table(rows, dtensor: dict) -> str:
    names = list(_streams.STREAMS)
    labels = {"add": "add", "mix": "mix (add/mul/relu)"}
    w = max(len(r[0]) for r in rows) + 2
    head1 = " " * w + "".join(f"{labels.get(s, s):>24}" for s in names)
    head2 = " " * w + "".join(f"{'us/op':>12}{'x DTensor':>12}" for _ in names)
    lines = [head1, head2]
    for label, vals in rows:
        cells = ""
        for s in names:
            ref = dtensor["streams"][s]["us_per_op"]
            cells += f"{vals[s]:>12.2f}{vals[s] / ref:>12.2f}"
        lines.append(f"{label:<{w}}{cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=10_000, help="ops timed per stream and repeat (default 10000)")
    parser.add_argument("--runner", default="thread", help="dtorch runner: thread (default), inline, or any registered one")
    parser.add_argument("--world-size", type=int, default=2, help="devices / torchrun ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up ops per stream before timing (default 300)")
    parser.add_argument("--json", dest="json_out", help="also write every number to this JSON file")
    parser.add_argument("--profile", action="store_true", help="cProfile the dtorch controller on a + a afterwards")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--anchor-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    import structlog

    # The bench is an entry point: keep library debug logs out of the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    started = time.perf_counter()
    plain = measure_plain(args.ops, args.repeats, args.warmup)
    dtorch = measure_dtorch(args.runner, args.world_size, args.ops, args.repeats, args.warmup)
    dtensor = measure_dtensor(args.world_size, args.ops, args.repeats, args.warmup, args.anchor_timeout)
    elapsed = time.perf_counter() - started

    rows = build_rows(dtorch, dtensor, plain)
    world = args.world_size
    print(
        f"dtorch dispatch bench: world {world}, dtorch runner '{args.runner}', {args.ops} ops per stream, "
        f"median of {args.repeats} repeats after {args.warmup} warm-up ops"
    )
    print(
        f"shapes: global ({_streams.SHARD_ROWS * world}, {_streams.COLS}) fp32, [Shard(0)] -> "
        f"{_streams.SHARD_ROWS}x{_streams.COLS} shards; plain torch on local {_streams.SHARD_ROWS}x{_streams.COLS}"
    )
    print(
        f"threads: OMP_NUM_THREADS=1 and torch.set_num_threads(1) in this process and every torchrun rank "
        f"(torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs)"
    )
    print(f"values checked against torch: dtorch {dtorch['values_ok']}, DTensor {dtensor['values_ok']}")
    print()
    print(format_table(rows, dtensor))
    print()
    ratio_mix = (dtorch["streams"]["mix"]["controller_us_per_op"] / dtensor["streams"]["mix"]["us_per_op"])
    print(f"ratio dtorch_controller/dtensor (mix) = {ratio_mix:.2f}")
    print(f"bench wall time {elapsed:.1f}s")
    ratio = dtorch["streams"]["add"]["controller_us_per_op"] / dtensor["streams"]["add"]["us_per_op"]
    print(f"ratio dtorch_controller/dtensor = {ratio:.2f} (target <= 1.0)")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "ops": args.ops,
                    "repeats": args.repeats,
                    "warmup": args.warmup,
                    "world_size": world,
                    "omp_num_threads": 1,
                    "torch_num_threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "dtorch": dtorch,
                    "dtensor": dtensor,
                    "plain_torch": plain,
                    "rows_us_per_op": {label: vals for label, vals in rows},
                    "ratio_dtorch_controller_over_dtensor": ratio,
                    "ratio_dtorch_controller_over_dtensor_mix": ratio_mix,
                },
                f,
                indent=2,
            )

    if args.profile:
        print()
        print(profile_dtorch(args.runner, world, args.ops, args.profile_top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
