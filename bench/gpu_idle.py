"""Where the GPU idles during a training step: plain torch against dtorch eager (process runner).

    python bench/gpu_idle.py [--families dit,gpt2] [--size large] [--steps 3] [--warmup 3] [--json out.json]

The blocks and the step are bench/model_steps.py's (bench/_blocks.py; forward, backward,
``torch.optim.AdamW(foreach=True)``, ``zero_grad``, a device sync). Each side runs ``--warmup``
steps, then ``--steps`` steps under torch.profiler: the torch side in this process, the dtorch
side in its worker process (bench/gpu_idle_hook/ is put on the path the workers inherit; its
``sitecustomize.py`` opens the window at the first ``dt.memory_stats()`` and closes it at the
next). Per step it prints the step's time between syncs, the GPU's busy time (the union of its
kernels), and the idle time: before the first kernel, between kernels by cause (see
gpu_idle_trace.py: waiting for the controller, worker busy, GPU side; on the torch side "worker
busy" is its one thread being behind) and after the last kernel; then the largest gaps.
Profiling adds CPU time per op on both sides, so the idle figures are upper bounds: compare the
sides with each other, and the step times with bench/model_steps.py's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
HOOK_DIR = os.path.join(BENCH_DIR, "gpu_idle_hook")
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, os.path.dirname(BENCH_DIR))  # run from a checkout without installing dtorch-core
sys.path.insert(0, HOOK_DIR)  # before dt.init: the workers take the controller's path

import _blocks
import gpu_idle_trace
from model_steps import DTYPES, Side, add_flush_options, set_flush_policy, train_step

SEND = "dtorch.send"  # the controller's flush of its pending instructions


def torch_window(side, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        with record_function(gpu_idle_trace.SYNC):
            side.sync()
        for i in range(steps):
            side.step_fn(side.model, side.opt, side.loss_fn, side.batches[i % len(side.batches)])
            with record_function(gpu_idle_trace.SYNC):
                side.sync()
    return gpu_idle_trace.summarise(prof)


def dtorch_window(dt, side, steps: int, out: str, window: int, stacks: bool = False):
    """The worker's summary of ``steps`` steps, and the controller's aten ops and sends meanwhile."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from dtorch_core.controller.session import Session

    flush = Session.flush

    def traced_flush(self):
        with record_function(SEND):
            return flush(self)

    Session.flush = traced_flush
    try:
        with profile(activities=[ProfilerActivity.CPU], with_stack=stacks) as prof:
            dt.memory_stats()  # opens the workers' window
            for _ in range(steps):
                side.step()
            with record_function(gpu_idle_trace.SYNC):
                dt.memory_stats()  # closes it; each worker writes its summary after its reply
    finally:
        Session.flush = flush
    deadline = time.monotonic() + 60
    while not (found := sorted(glob.glob(os.path.join(out, f"window{window}-worker*.json")))):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker summary in {out} (did the workers import the hook?)")
        time.sleep(0.1)
    with open(found[0]) as f:
        return json.load(f), gpu_idle_trace.cpu_events(prof)


def controller_during(events: list, start: float, end: float, top: int = 3) -> str:
    """What the controller ran while the GPU waited: its longest aten ops overlapping [start, end]
    (a nested op counts inside its parent) and its sends there."""
    inside = [e for e in events if e[1] > start and e[0] < end]
    sends = [e for e in inside if e[2] == SEND]
    ops = sorted((e for e in inside if e[2].startswith("aten::")), key=lambda e: e[0] - e[1])[:top]
    text = ", ".join(f"{n[6:]} {b - a:.0f}" for a, b, n in ops)
    # with --controller-stacks: the Python calls that span most of the gap, innermost first
    calls = sorted((e for e in inside if ".py(" in e[2] and "threading.py" not in e[2]
                    and e[1] - e[0] < 4 * (end - start)
                    and min(e[1], end) - max(e[0], start) > 0.5 * (end - start)), key=lambda e: e[1] - e[0])
    where = " < ".join(f"{n.rsplit('/', 1)[-1][:50]} {b - a:.0f}" for a, b, n in calls[:4])
    return f"controller: {len(sends)} sends, longest ops (us) {text}" + (f"\n               in {where}" if where else "")


def medians(summary: dict) -> dict:
    steps = summary["steps"]
    keys = ("wall_us", "busy_us", "kernels", "before_first_kernel_us", "idle_between_kernels_us",
            "after_last_kernel_us")
    row = {k: statistics.median(s[k] for s in steps) for k in keys}
    row["idle_by_cause_us"] = {c: statistics.median(s["idle_by_cause_us"][c] for s in steps)
                               for c in steps[0]["idle_by_cause_us"]}
    split = [s["start_split"] for s in steps if "start_split" in s]
    row["start_split_us"] = {k: statistics.median(v[k] for v in split) for k in (split[0] if split else ())
                             if all(v[k] is not None for v in split)}
    return row


def print_rows(family, size, rows: dict, summaries: dict, top: int, controller: list, kernel_diff: int = 0) -> None:
    for name, r in rows.items():
        causes = ", ".join(f"{c} {v / 1000:.2f}" for c, v in r["idle_by_cause_us"].items())
        print(f"{family:5s} {size:5s} {name:6s} | step {r['wall_us'] / 1000:7.2f} ms | busy "
              f"{r['busy_us'] / 1000:7.2f} ms, {r['kernels']:.0f} kernels | idle: before "
              f"{r['before_first_kernel_us'] / 1000:.2f}, between {r['idle_between_kernels_us'] / 1000:.2f} "
              f"({causes}), after {r['after_last_kernel_us'] / 1000:.2f} ms")
        if r.get("start_split_us"):
            print("              before the first kernel (us): " +
                  ", ".join(f"{k[:-3].replace('_', ' ')} {v:.0f}" for k, v in r["start_split_us"].items()))
    for name, summary in summaries.items():
        gaps = summary["steps"][len(summary["steps"]) // 2]["top_gaps"][:top]
        for g in gaps:
            print(f"      {name:6s} gap {g['us']:8.1f} us at {g['at_us'] / 1000:6.2f} ms  {g['cause']:27s} before "
                  f"{g['kernel'][:40]} (launched in {g['op']})")
            if name != "torch":
                print("             " + controller_during(controller, g["start_us"] - 300, g["start_us"] + g["us"]))
    if kernel_diff and "torch" in summaries and "eager" in summaries:
        mine, theirs = (summaries[n]["steps"][len(summaries[n]["steps"]) // 2]["kernel_names"] for n in ("eager", "torch"))
        diff = [(k, mine.get(k, [0, 0.0]), theirs.get(k, [0, 0.0])) for k in set(mine) | set(theirs)]
        diff = [d for d in diff if d[1][0] != d[2][0] or abs(d[1][1] - d[2][1]) > 20]
        diff.sort(key=lambda d: -abs(d[1][1] - d[2][1]))
        for k, (n, us), (tn, tus) in diff[:kernel_diff]:
            print(f"      kernels eager {n:4d} ({us:8.1f} us) vs torch {tn:4d} ({tus:8.1f} us)  {k}")
    if controller and summaries.get("eager"):
        ends = [e[1] for e in controller if e[2] == gpu_idle_trace.SYNC]
        worker_end = summaries["eager"]["steps"][-1]["begin_us"] + summaries["eager"]["steps"][-1]["wall_us"]
        print(f"      clocks: the controller's last sync ended {ends[-1] - worker_end:.0f} us after the worker's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default="dit,gpt2")
    parser.add_argument("--size", default=None, help="default large on cuda, tiny on cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=16, help="largest gaps printed per side")
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernel-diff", type=int, default=0,
                        help="print this many kernels whose count or summed time differ most between the sides")
    parser.add_argument("--controller-stacks", action="store_true",
                        help="profile the controller's Python calls too (slower: shows what it did in a gap)")
    add_flush_options(parser)
    args = parser.parse_args()
    set_flush_policy(args.flush_batch, args.flush_interval, args.flush_first, args.flush_growth)
    device = args.device
    dtype = DTYPES["bf16" if device == "cuda" else "fp32"]
    size = args.size or ("large" if device == "cuda" else "tiny")
    out = tempfile.mkdtemp(prefix="dtorch-gpu-idle-")
    os.environ["DTORCH_GPU_IDLE_OUT"] = out

    import dtorch_core as dt

    dt.init(world_size=1, runner="process", device_type=device)
    mesh = dt.init_device_mesh(device, (1,))
    sync_torch = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {}
    for window, family in enumerate(args.families.split(",")):
        torch.manual_seed(0)
        model, batch_fn, loss_fn = _blocks.make(family, size, dtype=dtype)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        batches = [batch_fn(i) for i in range(4)]
        side = Side("torch", model.to(device), [tuple(t.to(device) for t in b) for b in batches], loss_fn, sync_torch)
        for _ in range(args.warmup):
            side.step()
        summaries = {"torch": torch_window(side, args.steps)}
        del side, model
        fresh, _, _ = _blocks.make(family, size, dtype=dtype)
        fresh.load_state_dict(state, strict=False)
        dmodel = dt.nn.parallelize_module(fresh, mesh, {})
        dbatches = [tuple(dt.distribute_tensor(t, mesh, [dt.Replicate()]) for t in b) for b in batches]
        side = Side("eager", dmodel, dbatches, loss_fn, dt.synchronize, step=train_step)
        for _ in range(args.warmup):
            side.step()
        summaries["eager"], controller = dtorch_window(dt, side, args.steps, out, window, args.controller_stacks)
        del side, dmodel, dbatches
        rows = {name: medians(s) for name, s in summaries.items()}
        print_rows(family, size, rows, summaries, args.top, controller, args.kernel_diff)
        results[f"{family}/{size}"] = {"medians": rows, "summaries": summaries}
        sys.stdout.flush()
        if device == "cuda":
            torch.cuda.empty_cache()
    dt.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
