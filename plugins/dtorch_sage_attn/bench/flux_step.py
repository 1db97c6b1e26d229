"""One Flux denoising step on dtorch workers with ``DTORCH_ATTENTION=sdpa`` against ``auto``: the
step time ratio (sdpa / auto: above 1 means auto is faster) and the output's PSNR against the
SDPA step's output. Target on one H200: >= 1.15x at >= 30 dB.

The model is diffusers' FluxTransformer2DModel at FLUX.1-dev's widths (24 heads x 128, joint
attention dim 4096, pooled 768, in_channels 64, guidance embedding, RoPE 16+56+56) with few
blocks (``--layers`` double-stream, ``--single-layers`` single-stream; random weights), in bf16,
parallelized by ``dtorch_hf.parallelize`` on a ``--world-size`` mesh over ``--mesh-dim`` (``sp``:
Ulysses; ``tp``), at 1024x1024: 4096 image tokens (the VAE's 128x128 latent packed 2x2) and 512
text tokens (FluxPipeline's max_sequence_length). ``--tiny`` shrinks widths and tokens so the
step runs on the CPU in seconds (there every call runs SDPA: the ratio is ~1 and the PSNR inf).

Timing: both modes run the same model on the same inputs in one session (the mode is read by the
workers at each new decision). ``--warmup`` untimed steps per mode (auto's first step makes its
decisions: the candidates compile, are gated and timed), then ``--rounds`` rounds that alternate
the modes, each ``--iters`` steps synchronised and timed on the wall clock; the median step per
mode is reported.

    python plugins/dtorch_sage_attn/bench/flux_step.py                      # CUDA, 1 GPU
    python plugins/dtorch_sage_attn/bench/flux_step.py --tiny --device cpu  # a CPU check (seconds)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

FULL = {"in_channels": 64, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56), "patch_size": 1}
TINY = {"in_channels": 16, "attention_head_dim": 16, "num_attention_heads": 4, "joint_attention_dim": 32,
        "pooled_projection_dim": 16, "guidance_embeds": True, "axes_dims_rope": (4, 6, 6), "patch_size": 1}


def make_inputs(config, side: int, text: int, dtype, seed: int = 1) -> dict:
    """Flux's transformer inputs for a ``side`` x ``side`` grid of packed latent patches."""
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    return {"hidden_states": torch.randn(1, side * side, config["in_channels"], generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=g).to(dtype),
            "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g).to(dtype),
            "timestep": torch.tensor([0.5], dtype=dtype), "guidance": torch.tensor([3.5], dtype=dtype),
            "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(text, 3)}


def psnr(got: torch.Tensor, want: torch.Tensor) -> float:
    """10 log10(peak^2 / MSE), peak = the reference's largest magnitude."""
    got, want = got.float().cpu(), want.float().cpu()
    mse = float(((got - want) ** 2).mean())
    peak = float(want.abs().max())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small widths and tokens (a CPU check)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--mesh-dim", default="sp", choices=("sp", "tp"))
    parser.add_argument("--runner", default="thread")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    import dtorch_hf
    import dtorch_sage_attn
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging

    import dtorch_core as dt

    diffusers_logging.set_verbosity_error()
    config = dict(TINY if args.tiny else FULL, num_layers=args.layers, num_single_layers=args.single_layers)
    side, text = (4, 5) if args.tiny else (64, 512)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = FluxTransformer2DModel(**config).to(dtype).eval()
    dt.init(world_size=args.world_size, runner=args.runner, device_type=args.device)
    mesh = dt.init_device_mesh(args.device, (args.world_size,), mesh_dim_names=(args.mesh_dim,))
    dtorch_hf.parallelize(model, mesh)
    inputs = make_inputs(config, side, text, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"flux {args.layers}+{args.single_layers} blocks, {params / 1e9:.2f} B params, {side * side} image + {text} "
          f"text tokens, bf16, {args.device} x{args.world_size} ({args.mesh_dim}, {args.runner}); built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    def step():
        with torch.no_grad():
            return model(**inputs).sample

    modes = ("sdpa", "auto")
    outputs, times = {}, {mode: [] for mode in modes}
    for mode in modes:
        os.environ["DTORCH_ATTENTION"] = mode
        for _ in range(args.warmup):
            outputs[mode] = step().full_tensor()
    for _ in range(args.rounds):
        for mode in modes:
            os.environ["DTORCH_ATTENTION"] = mode
            for _ in range(args.iters):
                t = time.perf_counter()
                out = step()
                dt.synchronize()
                times[mode].append(time.perf_counter() - t)
            outputs[mode] = out.full_tensor()
    sdpa_ms, auto_ms = (statistics.median(times[m]) * 1e3 for m in modes)
    quality = psnr(outputs["auto"], outputs["sdpa"])
    ratio = sdpa_ms / auto_ms
    print(f"step: sdpa {sdpa_ms:.2f} ms, auto {auto_ms:.2f} ms; speed-up sdpa/auto {ratio:.3f}x "
          f"(target >= 1.15); auto vs sdpa output PSNR {quality:.1f} dB (target >= 30)", flush=True)
    print(f"controller routes: {dtorch_sage_attn.routes()}")
    sel = dtorch_sage_attn.get_selector()  # thread workers decide in this process
    for (gpu, key), decision in sorted(sel.decisions.items()):
        print(f"  {gpu} | {key}: {decision.choice} ({decision.reason}) times {decision.times_ms}")
    dt.shutdown()
    met = ratio >= 1.15 and quality >= 30
    print("targets met" if met else "targets MISSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
