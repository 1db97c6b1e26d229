"""Where the controller's time goes in a Flux/SD3 step: py-spy samples of diffusers against dtorch.

    python plugins/dtorch_hf/bench/controller_profile.py [--models sd3,flux] [--size full|cut] [--tiny]
        [--seconds 6] [--rate 250] [--top 25] [--json out.json]

For each model: the plain diffusers step and dtorch's eager step (world 1, the process runner on
CUDA) run back to back in a loop while ``py-spy record`` samples this process's main thread
(Python frames; time in C, a kernel launch or dtorch's native hot path, counts for the Python line
that called it). Per side it prints the steps per second, then the lines that hold the most
samples (leaf frames), and per source group (diffusers, torch, dtorch_core, dtorch_hf, other)
the share of samples whose innermost frame of ours or theirs is in it. The rows where dtorch's
share of a line exceeds diffusers' say which calls the distributed step pays for.

Needs ``py-spy`` (``pip install py-spy``) and permission to trace this process (ptrace).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _diffusion_models as models

GROUPS = ("dtorch_core", "dtorch_hf", "diffusers", "torch")


def group_of(frame: str) -> str:
    path = "/" + frame.rsplit("(", 1)[-1]
    for name in GROUPS:
        if f"/{name}/" in path:
            return name
    return "other"


def record(seconds: float, rate: int) -> list[tuple[list[str], int]]:
    """Samples of this process's main thread for ``seconds``: (frames outermost first, count)."""
    out = tempfile.mktemp(suffix=".txt")
    cmd = [shutil.which("py-spy") or "py-spy", "record", "--pid", str(os.getpid()), "--rate", str(rate),
           "--duration", str(int(seconds)), "--format", "raw", "--output", out, "--nonblocking", "--threads"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=seconds + 120)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"py-spy failed: {proc.stderr.strip()[-300:]}")
    main = threading.main_thread().native_id
    samples = []
    with open(out) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")  # the first is "thread (TID): NAME"
            if frames[0].startswith(f"thread ({main})"):
                samples.append((frames[1:], int(count)))
    os.unlink(out)
    return samples


def summarise(samples, top: int) -> dict:
    total = sum(c for _, c in samples) or 1
    leaves, groups = collections.Counter(), collections.Counter()
    for frames, count in samples:
        if not frames:
            continue
        leaves[frames[-1]] += count
        groups[group_of(frames[-1])] += count
    return {"samples": total,
            "groups": {g: groups[g] / total for g in GROUPS + ("other",)},
            "lines": [(frame, n / total) for frame, n in leaves.most_common(top)]}


def profile_side(step, sync, seconds: float, rate: int) -> tuple[dict, float]:
    """Run ``step`` in a loop while py-spy samples; returns (summary input, steps per second)."""
    stop = threading.Event()
    result = {}

    def sampler():
        result["samples"] = record(seconds, rate)
        stop.set()

    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    time.sleep(0.5)  # py-spy attaches
    n, t0 = 0, time.perf_counter()
    while not stop.is_set():
        step()
        sync()
        n += 1
    rate_steps = n / (time.perf_counter() - t0)
    t.join()
    return result["samples"], rate_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="sd3,flux")
    parser.add_argument("--size", default=None, help="full or cut (default full on cuda, cut on cpu)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--runner", default=None, help="default process on cuda, thread on cpu")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    size = args.size or ("full" if device == "cuda" else "cut")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runner = args.runner or ("process" if device == "cuda" else "thread")

    import dtorch_core as dt

    dt.init(world_size=1, runner=runner, device_type=device)
    mesh = dt.init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    sync_torch = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {}
    for name in args.models.split(","):
        results[name] = rows = profile_model(dt, name, size, args, mesh, dtype, device, sync_torch)
        print_model(name, size, rows)
        if device == "cuda":
            torch.cuda.empty_cache()
    dt.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def profile_model(dt, name, size, args, mesh, dtype, device, sync_torch) -> dict:
    cfg = models.config(name, size, tiny=args.tiny)
    inputs = models.make_inputs(name, cfg, models.tokens(name, tiny=args.tiny), 1, dtype, seed=0)
    sides = (("diffusers", models.diffusers_step(name, cfg, inputs, dtype, device), sync_torch),
             ("eager", models.dtorch_step(name, cfg, inputs, dtype, mesh), dt.synchronize))
    rows = {}
    for side, step, sync in sides:
        for _ in range(args.warmup):
            step()
        sync()
        samples, per_s = profile_side(step, sync, args.seconds, args.rate)
        rows[side] = dict(summarise(samples, args.top), steps_per_s=per_s)
    return rows


def print_model(name: str, size: str, rows: dict) -> None:
    base, mine = rows["diffusers"], rows["eager"]
    print(f"{name}/{size}: diffusers {1000 / base['steps_per_s']:.2f} ms a step, dtorch eager "
          f"{1000 / mine['steps_per_s']:.2f} ms ({base['steps_per_s'] / mine['steps_per_s']:.2f}x); "
          f"samples {base['samples']} / {mine['samples']}")
    print("  main thread's samples by the group of the innermost frame (diffusers / dtorch): "
          + ", ".join(f"{g} {base['groups'][g]:.0%} / {mine['groups'][g]:.0%}" for g in mine["groups"]))
    base_lines = dict(base["lines"])
    # a line's share of dtorch's samples, scaled to its step time, against diffusers' (ms a step)
    scale_mine, scale_base = 1000 / mine["steps_per_s"], 1000 / base["steps_per_s"]
    print("  dtorch's busiest lines: ms a step in dtorch / in diffusers (innermost frame)")
    for frame, share in mine["lines"]:
        theirs = base_lines.get(frame)
        theirs_text = f"{theirs * scale_base:6.2f}" if theirs is not None else "     -"
        print(f"    {share * scale_mine:6.2f} / {theirs_text}  {frame[:150]}")


if __name__ == "__main__":
    sys.exit(main())
