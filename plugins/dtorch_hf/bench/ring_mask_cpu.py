"""What an attention mask costs ring attention on the CPU: a no_grad forward of the tiny Flux of
tests/test_flux.py (config and inputs copied from gpu_ring_check.py: 15 image + 7 text tokens)
on sp=4, sp_mode="ring", without a mask (the anchor), with a text padding mask and with an
additive (1, 1, L, L) mask, interleaved in one run; prints the median time of each and its
ratio to the anchor.

    python plugins/dtorch_hf/bench/ring_mask_cpu.py --runner thread   # or process
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import dtorch_hf
import torch
from diffusers import FluxTransformer2DModel

import dtorch_core as dt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_ring_check import FLUX_CONFIG, flux_inputs, text_padding_mask  # noqa: E402


def additive_mask(inputs):
    total = inputs["encoder_hidden_states"].shape[1] + inputs["hidden_states"].shape[1]
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, 1, total, total, generator=g) * 0.5
    return bias.masked_fill(torch.rand(bias.shape, generator=g) > 0.8, float("-inf"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", default="thread", choices=("thread", "process"))
    parser.add_argument("--repeats", type=int, default=12, help="calls of each kind (the first 2 are warm-up)")
    args = parser.parse_args()
    dt.init(world_size=4, runner=args.runner)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX_CONFIG).eval()
    dtorch_hf.parallelize(model, dt.init_device_mesh("cpu", (4,), mesh_dim_names=("sp",)), sp_mode="ring")
    x = flux_inputs(3, 5, 7)
    masks = {"no mask": None, "text padding": text_padding_mask(x), "additive (1,1,L,L)": additive_mask(x)}
    times: dict = {name: [] for name in masks}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, mask in masks.items():
                kwargs = {} if mask is None else {"joint_attention_kwargs": {"attention_mask": mask}}
                start = time.perf_counter()
                model(**x, **kwargs).sample.full_tensor()
                times[name].append(time.perf_counter() - start)
    dt.shutdown()
    anchor = statistics.median(times["no mask"][2:])
    for name, ts in times.items():
        median = statistics.median(ts[2:])
        print(f"{args.runner} {name}: {median * 1e3:.1f} ms, {median / anchor:.2f}x the unmasked ring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
