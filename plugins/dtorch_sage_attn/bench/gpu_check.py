"""The plugin on CUDA, checked against plain torch on the same GPU (what CI, without a GPU, cannot
run): prints one line per check and exits 1 on any miss.

1. Each aten SDPA forward op's worker kernel (cuDNN, flash, memory-efficient) at a Flux shape
   (1x24x4608x128 bf16) and an SD3 shape (2x24x4429x64): the same outputs as the aten op
   (shapes, strides, dtypes, devices) and values at the gate (cosine >= 0.9995), with the
   selector's decision.
2. A small Flux transformer (dtorch_hf; 24 heads x 128, 1 + 1 blocks) on 4 thread workers on one
   GPU, tp=4, Ulysses sp=4 and ring sp=4, bf16, against the plain model: output rel err.

    python plugins/dtorch_sage_attn/bench/gpu_check.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _describe(o):
    if isinstance(o, torch.Tensor):
        return (tuple(o.shape), o.stride(), o.dtype, o.device.type)
    return o


def kernel_checks() -> int:
    from dtorch_sage_attn import get_selector
    from dtorch_sage_attn.routing import forward_ops
    from dtorch_sage_attn.worker_kernels import inference_kernel

    misses = 0
    shapes = {"flux": (1, 24, 4608, 128), "sd3": (2, 24, 4429, 64)}
    for label, (b, h, s, d) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        # diffusers' layout: (batch, seq, heads, dim) transposed to (batch, heads, seq, dim)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                   for _ in range(3))
        for op in forward_ops():
            name = op._schema.name.split("::")[1]
            if name.endswith("_for_cpu"):
                continue
            args = (q, k, v) if "flash" in name else (q, k, v, None, False)
            try:
                want = op(*args)
                got = inference_kernel(op)(*args)
            except Exception as exc:  # noqa: BLE001 - one line per case
                misses += 1
                print(f"{label} {name}: ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            same = [_describe(a) == _describe(b) for a, b in zip(got, want)]
            cos = F.cosine_similarity(got[0].float().reshape(-1), want[0].float().reshape(-1), dim=0).item()
            ok = all(same) and len(got) == len(want) and cos >= 0.9995
            misses += not ok
            print(f"{label} {name}: outputs alike {all(same)} {'' if all(same) else [(_describe(a), _describe(b)) for a, b in zip(got, want)]}, "
                  f"cosine vs SDPA {cos:.6f} {'ok' if ok else 'MISS'}", flush=True)
    for (gpu, key), decision in sorted(get_selector().decisions.items()):
        print(f"  {gpu} | {key}: {decision.choice} ({decision.reason}) times {decision.times_ms} gate {decision.gate}")
    return misses


def mesh_checks() -> int:
    import dtorch_hf
    from diffusers import FluxTransformer2DModel

    import dtorch_core as dt

    config = {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 256, "pooled_projection_dim": 64,
              "axes_dims_rope": (16, 56, 56)}
    side, text = 32, 64
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    inputs = {"hidden_states": torch.randn(1, side * side, 64, generator=g).bfloat16(),
              "encoder_hidden_states": torch.randn(1, text, 256, generator=g).bfloat16(),
              "pooled_projections": torch.randn(1, 64, generator=g).bfloat16(),
              "timestep": torch.tensor([0.5]).bfloat16(), "img_ids": img_ids.reshape(-1, 3),
              "txt_ids": torch.zeros(text, 3)}
    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**config).bfloat16().eval()
    with torch.no_grad():
        want = ref.cuda()(**{k: v.cuda() for k, v in inputs.items()}).sample.float().cpu()
    ref.cpu()
    misses = 0
    dt.init(world_size=4, runner="thread", device_type="cuda")
    for dim, sp_mode in (("tp", "ulysses"), ("sp", "ulysses"), ("sp", "ring")):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**config).bfloat16().eval()
        dtorch_hf.parallelize(model, dt.init_device_mesh("cuda", (4,), mesh_dim_names=(dim,)), sp_mode=sp_mode)
        try:
            with torch.no_grad():
                got = model(**inputs).sample.full_tensor().float().cpu()
        except Exception as exc:  # noqa: BLE001
            misses += 1
            print(f"mesh {dim}4 {sp_mode}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        err = ((got - want).norm() / want.norm()).item()
        ok = err <= 3e-2
        misses += not ok
        print(f"mesh {dim}4 {sp_mode}: output rel err vs plain {err:.2e} {'ok' if ok else 'MISS'}", flush=True)
    import dtorch_sage_attn

    print(f"controller routes: {dtorch_sage_attn.routes()}")
    dt.shutdown()
    return misses


def main() -> int:
    misses = kernel_checks() + mesh_checks()
    print(f"{misses} miss(es)" if misses else "all checks ok", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
