"""The shared body of ``sd3_generate.py`` and ``flux_generate.py``: load a pipeline with
``dtorch_hf.from_pretrained`` onto a (cfg, tp, sp) mesh, generate one image, write it as a PNG,
and (with ``--tiny``, or ``--check``) compare it with diffusers' pipeline on one device.

Nothing is downloaded: ``--tiny`` builds a tiny random pipeline and saves it in a temporary
directory; ``--model-dir`` takes a local directory written by ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import numpy as np
import torch

import dtorch_core as dt
import dtorch_hf
from dtorch_hf import tiny_pipelines

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(kind: str, description: str, argv=None):
    parser = argparse.ArgumentParser(description=description)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny", action="store_true", help=f"a tiny random {kind} pipeline (no weights needed)")
    source.add_argument("--model-dir", help="a local pipeline directory saved with save_pretrained")
    parser.add_argument("--prompt", default="a photo of a cat")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) size")
    parser.add_argument("--cfg", type=int, default=1, help="CFG-parallel size (1 or 2)")
    parser.add_argument("--runner", default="thread", help="thread, process or inline")
    parser.add_argument("--steps", type=int, default=None, help="inference steps (2 with --tiny, else 28)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="float32 with --tiny, else bfloat16")
    parser.add_argument("--check", action="store_true", help="compare with one device (always with --tiny)")
    parser.add_argument("--out", default=f"{kind}.png", help="where the PNG goes")
    return parser.parse_args(argv)


def _mesh(args):
    dims = [(n, name) for n, name in ((args.cfg, "cfg"), (args.tp, "tp"), (args.sp, "sp")) if n > 1] or [(1, "tp")]
    shape, names = tuple(n for n, _ in dims), tuple(name for _, name in dims)
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names), dict(zip(names, shape))


def _call(args, extra: dict) -> dict:
    if args.tiny:
        call = {"num_inference_steps": 2, "height": 20, "width": 24,
                "max_sequence_length": tiny_pipelines.T5_MAX_LENGTH}
    else:
        call = {"num_inference_steps": 28}
    call.update({k: v for k, v in (("num_inference_steps", args.steps), ("height", args.height),
                                   ("width", args.width)) if v is not None})
    return {**call, **extra}


def main(kind: str, description: str, extra: dict | None = None, argv=None) -> int:
    """Run the example for ``kind`` ("sd3" or "flux"); ``extra`` are pipeline call arguments."""
    args = parse(kind, description, argv)
    dtype = DTYPES[args.dtype or ("float32" if args.tiny else "bfloat16")]
    call = _call(args, extra or {})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_pipelines.save_tiny_pipeline(kind, tmp) if args.tiny else args.model_dir
        dt.init(world_size=args.cfg * args.tp * args.sp, runner=args.runner)
        mesh, dims = _mesh(args)
        start = time.perf_counter()
        pipe = dtorch_hf.from_pretrained(model_dir, mesh=mesh, torch_dtype=dtype)
        loaded = time.perf_counter() - start
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # dtorch's one-time "no sharding rule" notes
            start = time.perf_counter()
            image = pipe(args.prompt, generator=torch.Generator().manual_seed(args.seed), **call).images[0]
            seconds = time.perf_counter() - start
        image.save(args.out)
        print(f"{type(pipe).__name__} on mesh {dims}: loaded in {loaded:.2f} s, {call['num_inference_steps']} steps "
              f"in {seconds:.2f} s; wrote {args.out} {image.size}")
        print("replicated fallbacks:", dt.fallback_counts())
        dt.shutdown()
        if not (args.tiny or args.check):
            return 0
        from diffusers import DiffusionPipeline

        ref = DiffusionPipeline.from_pretrained(model_dir, dtype=dtype)
        want = ref(args.prompt, generator=torch.Generator().manual_seed(args.seed), **call).images[0]
    diff = np.abs(np.asarray(image, dtype=np.int16) - np.asarray(want, dtype=np.int16)).max()
    # fp32: values equal to ~1e-6, so a pixel may round one step apart; bf16 sums differ more
    same = diff <= (1 if dtype == torch.float32 else 8)
    print(f"equal to one device: {bool(same)} (largest pixel difference {diff})")
    return 0 if same else 1
