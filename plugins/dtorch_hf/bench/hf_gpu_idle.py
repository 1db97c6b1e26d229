"""Where the GPU idles in a Flux/SD3 denoising step: plain diffusers against dtorch eager.

    python plugins/dtorch_hf/bench/hf_gpu_idle.py [--models flux,sd3] [--size cut|full] [--steps 3]
        [--kernel-diff 8] [--json out.json]

The repository's ``bench/gpu_idle.py`` windows (torch.profiler on both sides: diffusers in this
process, dtorch in its process-runner worker through ``bench/gpu_idle_hook/``), around the step
``hf_models.py`` times: a no-grad forward of the transformer at 1024x1024 (world 1, bf16 on a GPU;
``--tiny`` runs small widths on the CPU, where aten ops stand in for kernels). It prints per side
the step between syncs, the GPU's busy time and kernel count, and the idle time before the first
kernel, between kernels by cause (waiting for the controller, worker busy, GPU side) and after the
last, then the largest gaps and what the controller ran meanwhile. Run it from a checkout (it
imports ``bench/gpu_idle.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_BENCH = os.path.join(HERE, "..", "..", "..", "bench")
sys.path.insert(0, HERE)
sys.path.insert(0, CORE_BENCH)
sys.path.insert(0, os.path.join(CORE_BENCH, "gpu_idle_hook"))  # before dt.init: the workers take the path

import _diffusion_models as models
import gpu_idle


class Steps:
    """A step as ``gpu_idle``'s windows call it: ``step_fn(...)`` issues one, ``step()`` also syncs."""

    def __init__(self, call, sync):
        self.call, self.sync = call, sync
        self.model = self.opt = self.loss_fn = None
        self.batches = [None]

    def step_fn(self, *_):
        return self.call()

    def step(self):
        self.call()
        self.sync()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="flux,sd3")
    parser.add_argument("--size", default="cut", help="cut (4 blocks) or full")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--kernel-diff", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    os.environ["DTORCH_GPU_IDLE_OUT"] = out = tempfile.mkdtemp(prefix="dtorch-hf-gpu-idle-")

    import dtorch_core as dt

    dt.init(world_size=1, runner="process", device_type=device)
    mesh = dt.init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    sync_torch = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {}
    for window, name in enumerate(args.models.split(",")):
        cfg = models.config(name, args.size, tiny=args.tiny)
        inputs = models.make_inputs(name, cfg, models.tokens(name, tiny=args.tiny), 1, dtype, seed=0)
        side = Steps(models.diffusers_step(name, cfg, inputs, dtype, device), sync_torch)
        for _ in range(args.warmup):
            side.step()
        summaries = {"torch": gpu_idle.torch_window(side, args.steps)}
        del side  # the diffusers model goes before the distributed one is built
        side = Steps(models.dtorch_step(name, cfg, inputs, dtype, mesh), dt.synchronize)
        for _ in range(args.warmup):
            side.step()
        summaries["eager"], controller = gpu_idle.dtorch_window(dt, side, args.steps, out, window)
        rows = {k: gpu_idle.medians(v) for k, v in summaries.items()}
        gpu_idle.print_rows(name, args.size, rows, summaries, args.top, controller, args.kernel_diff)
        results[f"{name}/{args.size}"] = {"medians": rows, "summaries": summaries}
        sys.stdout.flush()
        del side
        if device == "cuda":
            torch.cuda.empty_cache()
    dt.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
