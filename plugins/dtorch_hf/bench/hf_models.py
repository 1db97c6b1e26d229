"""One denoising step of Flux- and SD3-shaped diffusers transformers: dtorch against plain diffusers.

    python plugins/dtorch_hf/bench/hf_models.py [--models flux,sd3] [--sizes full,cut] [--tiny]
        [--device cuda] [--dtype bf16] [--runner process] [--world-size N] [--mesh tp=2,sp=2]
        [--sp-mode ulysses|ring] [--batch 1] [--cfg] [--text-tokens T] [--warmup 5] [--iters 5] [--rounds 3]
        [--check] [--profile] [--top 12] [--json out.json]

A step is one transformer forward (inference, ``torch.no_grad()``) at 1024x1024 (4096 image
tokens; Flux 512 text tokens, SD3 333) on the models of ``_diffusion_models.py`` (random
weights created where they live, full depth and a 4-block cut). Three sides in one run, on the
same inputs:
  diffusers  the plain diffusers model on one device (the anchor)
  eager      the same class parallelized by ``dtorch_hf.parallelize`` over the mesh (``--mesh``,
             default ``tp=<world size>``), called directly
  replay     the same dtorch model's forward under ``dt.compile`` (captured once, then one
             RunProgram per step)
Every step ends with a device synchronisation (``torch.cuda.synchronize()``, ``dt.synchronize()``)
and is timed on the wall clock; after ``--warmup`` untimed steps per side, ``--rounds`` rounds
of ``--iters`` steps interleave the sides, and each side's median step is reported with its
ratio to the diffusers step of the same run (targets: eager <= 1.03x, replay <= 1.0x).

Checks: the output shapes are equal, the outputs finite, replay's output equals eager's; with
``--check`` (default with ``--tiny``) the dtorch model's weights are copied into the diffusers
model afterwards and the outputs compared (everything crosses the controller: small models only).

``--profile`` (``_profiling.py``), after the timing: on CUDA the kernels of one step of each side
(count, summed time against the step's wall time, the kernels that differ most from diffusers'
with the ops that launched them; dtorch's only with ``--runner thread``, where the workers run
in this process), the aten ops one eager step plans against those diffusers calls, and a
cProfile of the controller issuing one eager step (any runner).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _diffusion_models as models
import _profiling

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGETS = {"eager": 1.03, "replay": 1.0}
SIDES = ("diffusers", "eager", "replay")


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"tp=2,sp=2"`` -> ((2, 2), ("tp", "sp"))."""
    shape, names = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh {text!r}: write it as name=size[,name=size...], e.g. tp=2,sp=2")
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:1000] if str(exc) else ''}"


class Side:
    """One way of running the step, with its timings (wall time of call + synchronise, and the
    time the call itself took to return: for dtorch, the controller's issue time)."""

    def __init__(self, name, call, sync):
        self.name, self.call, self.sync = name, call, sync
        self.times: list[float] = []
        self.issued: list[float] = []
        self.out = None
        self.error: str | None = None

    def step(self) -> float:
        t0 = time.perf_counter()
        self.out = self.call()
        issued = time.perf_counter() - t0
        self.sync()
        elapsed = time.perf_counter() - t0
        self.issued.append(issued)
        return elapsed

    def guarded(self, n: int, keep: bool) -> None:
        if self.error:
            return
        try:
            for _ in range(n):
                t = self.step()
                if keep:
                    self.times.append(t)
        except Exception as exc:  # noqa: BLE001 - a side that fails is reported, the others still run
            self.error = first_line(exc)


def full(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def rel_err(got, want) -> float:
    got, want = full(got).float().cpu(), full(want).float().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def runner_in_process(args) -> bool:
    return args.runner in ("thread", "inline")


def run_case(dt, args, name, size, mesh, dtype, device) -> dict:
    cfg = models.config(name, size, tiny=args.tiny)
    toks = models.tokens(name, tiny=args.tiny, text=args.text_tokens)
    inputs = models.make_inputs(name, cfg, toks, args.batch, dtype, seed=args.seed)
    sync_torch = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    case = {"params": models.parameter_count(cfg, name), "image_tokens": models.image_tokens(toks),
            "text_tokens": toks["text"], "batch": args.batch, "config": cfg, "build_s": {}}
    try:
        t0 = time.perf_counter()
        dmodel = models.build_dtorch(name, cfg, dtype, mesh, args.sp_mode)
        dinputs = models.place_inputs(inputs, mesh)
        dt.synchronize()
        case["build_s"]["dtorch"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - e.g. a mesh dim or sp mode the family refuses
        case["error"] = f"dtorch_hf.parallelize: {first_line(exc)}"
        return case
    t0 = time.perf_counter()
    anchor = models.build_diffusers(name, cfg, dtype, device)
    anchor_inputs = {k: v.to(device) for k, v in inputs.items()}
    sync_torch()
    case["build_s"]["diffusers"] = time.perf_counter() - t0

    def anchor_step():
        with torch.no_grad():
            return anchor(**anchor_inputs, return_dict=False)[0]

    def forward(**kw):
        with torch.no_grad():
            return dmodel(**kw, return_dict=False)[0]

    compiled = dt.compile(forward)
    sides = [Side("diffusers", anchor_step, sync_torch), Side("eager", lambda: forward(**dinputs), dt.synchronize),
             Side("replay", lambda: compiled(**dinputs), dt.synchronize)]
    for side in sides:
        side.guarded(args.warmup, keep=False)
    gc.collect()
    replays_before = compiled.replays
    for _ in range(args.rounds):
        for side in sides:
            side.guarded(args.iters, keep=True)
    if sides[2].error is None and compiled.replays - replays_before < len(sides[2].times):
        sides[2].error = ("some timed replay steps were not replays: use --warmup 3 or more (dt.compile runs "
                          "once eagerly and records twice before it replays)")

    rows = {}
    for side in sides:
        if side.error:
            rows[side.name] = {"error": side.error}
            continue
        n = len(side.times)
        rows[side.name] = {"ms": 1000 * statistics.median(side.times),
                           "min_ms": 1000 * min(side.times), "max_ms": 1000 * max(side.times),
                           "issue_ms": 1000 * statistics.median(side.issued[-n:]), "steps": n}
    case["rows"] = rows
    case["checks"] = checks(sides, anchor, dmodel, anchor_step, args, dtype)
    if args.profile and device == "cuda":
        # the dtorch sides' kernels are seen only where the workers run in this process
        seen = [s for s in sides if not s.error and (s.name == "diffusers" or runner_in_process(args))]
        case["profile"] = {s.name: _profiling.kernels(s, args.top > 0) for s in seen}
    if args.profile and not sides[1].error:
        case["controller_profile"] = _profiling.controller(sides[1], args.top or 15)
        case["aten_ops"] = _profiling.aten_op_summary(sides[0], sides[1], args.top or 15)
    compiled.reset()  # the captured program's buffers on the workers go with it
    return case


def release(dt, device) -> None:
    """Free the last case's models (the worker frees its shards when their handles die)."""
    gc.collect()
    dt.synchronize()
    if device == "cuda":
        torch.cuda.empty_cache()


def checks(sides, anchor, dmodel, anchor_step, args, dtype) -> dict:
    """Shapes, finiteness, replay against eager, and with --check dtorch against diffusers."""
    out = {}
    ref = sides[0].out
    if ref is not None:
        out["diffusers_finite"] = bool(torch.isfinite(ref).all())
    for side in sides[1:]:
        if side.error or side.out is None:
            continue
        got = side.out
        out[f"{side.name}_shape_equal"] = ref is not None and tuple(got.shape) == tuple(ref.shape)
        out[f"{side.name}_finite"] = bool(torch.isfinite(full(got)).all())
    if all(not s.error and s.out is not None for s in sides[1:]):
        out["replay_vs_eager"] = rel_err(sides[2].out, sides[1].out)
    if args.check and not sides[1].error:
        models.copy_weights(dmodel, anchor)
        out["dtorch_vs_diffusers"] = rel_err(sides[1].out, anchor_step())
        out["tolerance"] = 1e-4 if dtype == torch.float32 else 3e-2
    return out


def failures(case) -> list[str]:
    bad = [f"{k}: {v['error']}" for k, v in case.get("rows", {}).items() if "error" in v]
    if "error" in case:
        bad.append(case["error"])
    c = case.get("checks", {})
    bad += [f"check {k} failed" for k, v in c.items() if v is False]
    if c.get("replay_vs_eager", 0.0) > c.get("tolerance", 3e-2):
        bad.append(f"replay differs from eager by {c['replay_vs_eager']:.2e}")
    if c.get("dtorch_vs_diffusers", 0.0) > c.get("tolerance", 1.0):
        bad.append(f"dtorch differs from diffusers by {c['dtorch_vs_diffusers']:.2e} (relative)")
    return bad


def print_case(label, case, args) -> None:
    rows = case.get("rows", {})
    base = rows.get("diffusers", {}).get("ms")
    n = case["params"]
    text = f"{label:10s} {n / 1e9:6.2f}B" if n >= 1e8 else f"{label:10s} {n / 1e6:6.2f}M"
    for side in SIDES:
        row = rows.get(side)
        if row is None or "error" in row:
            text += f" | {side:9s}   FAILED        "
            continue
        ratio = row["ms"] / base if base else float("nan")
        text += f" | {side:9s} {row['ms']:9.2f} ms {ratio:5.3f}x"
        if side in TARGETS:
            text += " ok" if ratio <= TARGETS[side] else " MISS"
    print(text)
    if "eager" in rows and "ms" in rows["eager"]:
        print(f"{'':17s} eager issued in {rows['eager']['issue_ms']:.2f} ms, replay in "
              f"{rows.get('replay', {}).get('issue_ms', float('nan')):.2f} ms; build s: "
              + ", ".join(f"{k} {v:.1f}" for k, v in case["build_s"].items()))
    c = case.get("checks", {})
    if "replay_vs_eager" in c or "dtorch_vs_diffusers" in c:
        print(f"{'':17s} checks: " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in c.items()))
    for problem in failures(case):
        print(f"{'':17s} {problem}")
    prof = case.get("profile")
    if prof:
        for side, p in prof.items():
            print(f"{'':17s} profile {side:9s}: {p['kernels']:6d} kernels, GPU {p['gpu_ms']:9.2f} ms of "
                  f"{p['wall_ms']:9.2f} ms wall ({100 * p['gpu_busy']:.0f}% busy)")
        _profiling.print_kernel_diff(prof, args.top, " " * 21)
    if "aten_ops" in case:
        ops = case["aten_ops"]
        print(f"{'':17s} aten ops per step: " + ", ".join(f"{k} {v}" for k, v in ops["counts"].items())
              + "; differing (eager vs diffusers): " + ", ".join(f"{k} {a}/{b}" for k, a, b in ops["differing"]))
    if "controller_profile" in case:
        print(f"{'':17s} controller, one eager step (cProfile):")
        print("\n".join(line for line in case["controller_profile"].splitlines() if line.strip()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models.MODELS))
    parser.add_argument("--sizes", default=",".join(models.SIZES), help="full (real depth) and/or cut (4 blocks)")
    parser.add_argument("--tiny", action="store_true", help="small widths and token counts (CPU tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--runner", default=None, help="default process on cuda, thread on cpu")
    parser.add_argument("--world-size", type=int, default=None, help="default: the mesh's size, else 1")
    parser.add_argument("--mesh", default=None, help="named mesh dims, e.g. tp=2,sp=2 (default tp=<world size>)")
    parser.add_argument("--sp-mode", default="ulysses", help="passed to dtorch_hf.parallelize (ulysses, ring)")
    parser.add_argument("--batch", type=int, default=1, help="images per step")
    parser.add_argument("--cfg", action="store_true",
                        help="a classifier-free-guidance step: the conditional and unconditional halves as one "
                             "batch of 2 x --batch (both sides); a 'cfg' mesh dim splits it")
    parser.add_argument("--text-tokens", type=int, default=None, help="default: Flux 512, SD3 333")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per side (dt.compile records in 3)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare dtorch with diffusers on copied weights (default: with --tiny)")
    parser.add_argument("--profile", action="store_true", help="profile one step per side (use --runner thread)")
    parser.add_argument("--top", type=int, default=0, help="with --profile: kernels and controller functions shown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    runner = args.runner = args.runner or ("process" if device == "cuda" else "thread")
    if args.check is None:
        args.check = args.tiny
    if args.cfg:
        args.batch *= 2
    world = args.world_size
    shape, names = parse_mesh(args.mesh or f"tp={world or 1}")
    world = world or int(torch.Size(shape).numel())
    if torch.Size(shape).numel() != world:
        raise SystemExit(f"--mesh {args.mesh} has {torch.Size(shape).numel()} devices, --world-size {world}")

    import diffusers

    import dtorch_core as dt

    dt.init(world_size=world, runner=runner, device_type=device)
    mesh = dt.init_device_mesh(device, shape, mesh_dim_names=names)
    dt.manual_seed(args.seed)
    torch.manual_seed(args.seed)
    header = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": str(dtype), "runner": runner, "world_size": world, "mesh": dict(zip(names, shape)),
              "sp_mode": args.sp_mode, "torch": torch.__version__, "diffusers": diffusers.__version__,
              "tiny": args.tiny, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(sys.argv)}
    print(f"hf models: {header['gpu']}, {dtype}, runner {runner}, world {world}, mesh {args.mesh or f'tp={world}'}, "
          f"sp_mode {args.sp_mode}, torch {torch.__version__}, diffusers {diffusers.__version__}; median of "
          f"{args.rounds}x{args.iters} steps; ratio = time / diffusers time (targets: eager <= 1.03, replay <= 1.0)")
    results, bad = {}, []
    for name in args.models.split(","):
        for size in args.sizes.split(","):
            label = f"{name}/{size}"
            case = run_case(dt, args, name, size, mesh, dtype, device)
            release(dt, device)
            print_case(label, case, args)
            sys.stdout.flush()
            bad += [f"{label}: {p}" for p in failures(case)]
            results[label] = case
    dt.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, results=results, failures=bad), f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
