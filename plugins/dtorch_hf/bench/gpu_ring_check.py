"""Ring attention (``sp_mode="ring"``) on CUDA against the plain diffusers model on the same GPU:
the tiny Flux and SD3 transformers of tests/test_flux.py and tests/test_sd3.py (their configs and
inputs, copied: this runs from an installed plugin, without the tests), 4 thread-runner workers
on one GPU, meshes sp=4 and tp=2 x sp=2, uneven text and image lengths, fp32 and bf16. Each case
checks that the forward passed K/V round the ring (shift collectives), the output and the
gradient of ``output.sum()`` with respect to the input hidden_states (rel err <= 1e-4 in fp32,
2e-2 in bf16), prints one line, and the script exits 1 on any miss.

On the device, after ``pip install --no-deps --target /tmp/plug plugins/dtorch_hf`` (and diffusers
in /tmp/site), from /tmp:
    PYTHONPATH=/tmp/plug:/tmp/site:$REPO python3 $REPO/plugins/dtorch_hf/bench/gpu_ring_check.py
``--device cpu`` runs the same checks on the CPU kernels (the fallback the tests cover).
``--mask`` runs the Flux cases with a text padding mask (``joint_attention_kwargs``' boolean
``attention_mask``, the last 2 text tokens masked as keys; SD3 takes no mask).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import dtorch_hf
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging

import dtorch_core as dt

FLUX_CONFIG = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
               "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}
SD3_CONFIG = {"sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
              "num_attention_heads": 4, "joint_attention_dim": 16, "caption_projection_dim": 32,
              "pooled_projection_dim": 16, "out_channels": 4, "pos_embed_max_size": 8, "qk_norm": "rms_norm",
              "dual_attention_layers": (0,)}
MESHES = {"sp4": ((4,), ("sp",)), "tp2xsp2": ((2, 2), ("tp", "sp"))}
DTYPES = {"fp32": (torch.float32, 1e-4), "bf16": (torch.bfloat16, 2e-2)}
FLOAT_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections")


def flux_inputs(h, w, txt):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {"hidden_states": torch.randn(1, h * w, 16, generator=g),
            "encoder_hidden_states": torch.randn(1, txt, 32, generator=g),
            "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([0.3]),
            "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(txt, 3)}


def sd3_inputs(h, w, txt):
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, h, w, generator=g),
            "encoder_hidden_states": torch.randn(1, txt, 16, generator=g),
            "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([0.3])}


# family -> (config, {case: inputs}): 16 image + 5 text tokens (the joint 21 uneven over 4), and
# 15 image + 7 text (both streams uneven)
FAMILIES = {"flux": (FLUX_CONFIG, {"16img+5txt": lambda: flux_inputs(4, 4, 5), "15img+7txt": lambda: flux_inputs(3, 5, 7)}),
            "sd3": (SD3_CONFIG, {"16img+5txt": lambda: sd3_inputs(8, 8, 5), "15img+7txt": lambda: sd3_inputs(6, 10, 7)})}


def rel_err(got, want) -> float:
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def text_padding_mask(inputs):
    """(1, 1, 1, text + image) bool over Flux's joint sequence (text first): the last 2 text
    tokens masked as keys."""
    txt, img = inputs["encoder_hidden_states"].shape[1], inputs["hidden_states"].shape[1]
    mask = torch.ones(1, 1, 1, txt + img, dtype=torch.bool)
    mask[..., txt - 2:txt] = False
    return mask


def _mask_kwargs(mask, device):
    return {} if mask is None else {"joint_attention_kwargs": {"attention_mask": mask.to(device)}}


def _plain_grad(cls, path, inputs, dtype, device, mask=None):
    ref = cls.from_pretrained(path).to(device, dtype)
    x = {k: (v.detach().to(device, dtype) if k in FLOAT_INPUTS else v.to(device)) for k, v in inputs.items()}
    x["hidden_states"].requires_grad_()
    ref(**x, **_mask_kwargs(mask, device)).sample.sum().backward()
    return x["hidden_states"].grad


def check(cls, path, mesh, inputs, dtype, device, sp_mode="ring", mask=None) -> tuple[float, float, float | None]:
    """(output rel err, hidden_states gradient rel err) of the sp-parallel model against the plain
    one, and for a low-precision dtype the plain model's own gradient error against fp32 (the
    noise floor the parallel model's gradient error is to be read against)."""
    # loaded in fp32, then cast: SD3 loaded with torch_dtype=bf16 keeps its patch conv in fp32
    ref = cls.from_pretrained(path).to(device, dtype)
    model = cls.from_pretrained(path).to(dtype)
    dtorch_hf.parallelize(model, mesh, sp_mode=sp_mode)
    inputs = {k: (v.to(dtype) if k in FLOAT_INPUTS else v) for k, v in inputs.items()}
    ref_inputs = {k: v.to(device) for k, v in inputs.items()}
    ref_inputs["hidden_states"].requires_grad_()
    placed = {k: dt.distribute_tensor(v, mesh, [dt.Replicate()] * mesh.ndim) for k, v in inputs.items()}
    placed["hidden_states"].requires_grad_()
    with dt.debug.comm_mode() as comm:
        got = model(**placed, **_mask_kwargs(mask, "cpu")).sample
    want = ref(**ref_inputs, **_mask_kwargs(mask, device)).sample
    if not isinstance(got, dt.DTensor):
        raise TypeError("the parallel model's output is no DTensor")
    if sp_mode == "ring" and not comm.counts().get("shift"):  # the ring's K/V passes: else attention ran another way
        raise RuntimeError(f"no shift collective in the forward (ring attention not used): {comm.counts()}")
    got.sum().backward()
    want.sum().backward()
    floor = None
    if dtype != torch.float32:
        floor = rel_err(ref_inputs["hidden_states"].grad, _plain_grad(cls, path, inputs, torch.float32, device, mask))
    return rel_err(got, want), rel_err(placed["hidden_states"].grad, ref_inputs["hidden_states"].grad), floor


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sp-mode", default="ring", choices=("ring", "ulysses"),
                        help="ulysses: the same cases through Ulysses, to compare its bf16 errors")
    parser.add_argument("--mask", action="store_true", help="Flux only, with a text padding attention mask")
    args = parser.parse_args()
    # fp32 compares at 1e-4: no TF32 in the plain model's matmuls and convolutions (thread
    # workers share these flags)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    diffusers_logging.set_verbosity_error()
    classes = {"flux": FluxTransformer2DModel, "sd3": SD3Transformer2DModel}
    dt.init(world_size=4, runner="thread", device_type=args.device)
    misses = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family, (config, cases) in FAMILIES.items():
            if args.mask and family != "flux":
                continue
            torch.manual_seed(0)
            path = f"{tmp}/{family}"
            classes[family](**config).save_pretrained(path)
            for mesh_name, (shape, names) in MESHES.items():
                mesh = dt.init_device_mesh(args.device, shape, mesh_dim_names=names)
                for dtype_name, (dtype, tolerance) in DTYPES.items():
                    for case, make in cases.items():
                        label = f"{family} {mesh_name} {dtype_name} {case}" + (" masked" if args.mask else "")
                        inputs = make()
                        mask = text_padding_mask(inputs) if args.mask else None
                        try:
                            out_err, grad_err, floor = check(classes[family], path, mesh, inputs, dtype,
                                                             args.device, args.sp_mode, mask)
                        except Exception as exc:  # noqa: BLE001 - one line per case, then the next case
                            misses += 1
                            print(f"{label}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                                  flush=True)
                            continue
                        # a bf16 gradient is read against the plain model's own bf16 error: where the
                        # plain bf16 gradient is itself far from fp32 (Flux: 0.06-0.6 on one H200),
                        # two bf16 runs cannot agree to 2e-2 either
                        grad_bound = tolerance if floor is None else max(tolerance, 1.5 * floor)
                        ok = out_err <= tolerance and grad_err <= grad_bound
                        misses += not ok
                        noise = "" if floor is None else f"; plain {dtype_name} grad vs fp32 {floor:.2e}"
                        print(f"{label}: output rel err {out_err:.2e}, hidden_states grad rel err {grad_err:.2e} "
                              f"(<= {tolerance:.0e}){noise} {'ok' if ok else 'MISS'}", flush=True)
    dt.shutdown()
    print(f"{misses} miss(es)" if misses else "all cases ok", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
