"""The transformer block of bench/tp_scaling.py and its DTensor anchor: one definition, one plan.

The block is examples/train_gpt.py's ``Block`` (pre-norm LayerNorm, causal self-attention with
separate q/k/v Linears, a 4*d GELU MLP, residuals). Its tensor-parallel plan: column-wise
q, k, v and fc, row-wise attention and MLP projections (Megatron style: two all-reduces forward,
two backward per block). A step is forward and backward of ``y = block(x)`` with ``y.backward(g)``
for a fixed random ``g`` (no optimizer).
"""

from __future__ import annotations

import os

# NVLink multicast stays off in every process we start or import (issue 7, KINDS.md).
for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value

import argparse  # noqa: E402
import contextlib  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import _gpt  # noqa: E402  (puts the repository root on sys.path too)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PLAN_COL = ("attn.q", "attn.k", "attn.v", "mlp.fc")
PLAN_ROW = ("attn.proj", "mlp.proj")


def add_block_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (NCCL; dtorch with the dtorch_nccl plugin) or cpu (gloo; for testing)")
    p.add_argument("--d-model", type=int, default=8192)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=["cpu", "device"], default=None,
                   help="cpu: build the block on the CPU from --seed, the same weights on every side "
                        "(values compared); device: weights drawn where they live, nothing built on a "
                        "CPU (fast at d=8192; values not compared). Default: device on cuda, cpu on cpu")


def block_args(args) -> list[str]:
    """The block options as command-line arguments (for the anchor)."""
    return ["--device", args.device, "--d-model", args.d_model, "--heads", args.heads, "--seq-len",
            args.seq_len, "--batch", args.batch, "--dtype", args.dtype, "--seed", args.seed, "--init", init_mode(args)]


def init_mode(args) -> str:
    return args.init or ("device" if args.device == "cuda" else "cpu")


def config(args):
    return _gpt.load_example().GPTConfig(seq_len=args.seq_len, d_model=args.d_model, heads=args.heads, layers=1)


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_block(args, device: str | None = None):
    """The block in ``--dtype``: on the CPU from ``--seed`` (device None), or on ``device``/meta."""
    ex = _gpt.load_example()
    dtype = DTYPES[args.dtype]
    if device is None:
        torch.manual_seed(args.seed)
        with default_dtype(dtype):
            return ex.Block(config(args))
    with default_dtype(dtype), torch.device(device):
        return ex.Block(config(args))


def inputs(args):
    """(x, g) on the CPU: the block's input and the gradient fed to backward, from ``--seed``."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.seq_len, args.d_model)
    dtype = DTYPES[args.dtype]
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def fwd_bwd(block, x, g):
    """One step: gradients cleared, forward, backward."""
    block.zero_grad(set_to_none=True)
    block(x).backward(g)


def flops(args) -> float:
    """Matmul FLOPs of one step (forward + backward = 3x forward), attention's two products causal-halved."""
    tokens = args.batch * args.seq_len
    d = args.d_model
    linears = 2 * tokens * (4 * d * d + 2 * d * 4 * d)  # q, k, v, proj + fc, proj
    attention = 2 * 2 * args.batch * args.seq_len * args.seq_len * d / 2
    return 3 * (linears + attention)
