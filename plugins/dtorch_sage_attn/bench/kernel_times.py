"""Where a call's GPU time goes: each CUDA kernel's time (torch.profiler) for SDPA, our Triton
kernel and the Gluon one at the given shapes (the K/V pre-pass's two kernels apart from the
attention kernel). Needs a CUDA GPU; the Gluon rows need sm_90.

    python plugins/dtorch_sage_attn/bench/kernel_times.py [--shapes flux,sd3_cfg] [--calls 20]
"""

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import SHAPES, make_inputs, sdpa  # noqa: E402


def kernel_times(fn, calls):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:60]] += event.device_time / calls / 1000.0
    return per_kernel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="flux,sd3_cfg,prefill_causal_gqa,short")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    from dtorch_sage_attn.triton_sage import GLUON_CONFIG, _sage_attention, launch_config

    for name in args.shapes.split(","):
        shape = SHAPES[name]
        q, k, v = make_inputs(shape, "offsets")
        causal = shape[5]
        triton_cfg = launch_config(shape[4], causal)._replace(gluon=0)
        runs = {"sdpa": lambda: sdpa(q, k, v, causal),
                "triton": lambda: _sage_attention(q, k, v, causal, None, False, triton_cfg),
                "gluon": lambda: _sage_attention(q, k, v, causal, None, False, GLUON_CONFIG)}
        for kname, fn in runs.items():
            times = kernel_times(fn, args.calls)
            total = sum(times.values())
            parts = ", ".join(f"{n} {ms:.4f}" for n, ms in sorted(times.items(),
                                                                  key=lambda x: -x[1]))
            print(f"{name:20s} {kname:7s} GPU {total:.4f} ms a call: {parts}", flush=True)


if __name__ == "__main__":
    main()
