"""The worker kernels return what the aten op they stand for returns, whichever kernel ran: for
every SDPA forward op (CUDA's too: their outputs are laid out from the ops' meta kernels, which
run on the CPU) the same number of outputs with the same shapes, strides and dtypes; and on CPU
tensors the kernel with a stand-in candidate gives the aten op's values."""

from __future__ import annotations

import pytest
import torch
from dtorch_sage_attn import AttentionCall, Selector, set_selector
from dtorch_sage_attn.records import SDPA
from dtorch_sage_attn.routing import forward_ops
from dtorch_sage_attn.worker_kernels import (
    OutputLayout,
    bind,
    inference_kernel,
    needs_lse,
)
from standins import exact, fixed_times, standin

OPS = {op._schema.name.split("::")[1]: op for op in forward_ops()}


def _diffusers_layout(b, h, s, d, seed=0):
    """(batch, heads, seq, dim) views of (batch, seq, heads, dim) tensors, as diffusers passes them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(3)]


def _args(name, q, k, v, lse):
    if "flash" in name:
        return (q, k, v)
    return (q, k, v, None, lse)


# the flash ops always return their log-sum-exp; the others with compute_log_sumexp
CASES = [(name, lse) for name in sorted(OPS) for lse in ((True,) if "flash" in name else (False, True))]


@pytest.mark.parametrize("name, lse", CASES)
def test_packed_outputs_match_the_aten_op_layout(name, lse):
    op = OPS[name]
    q, k, v = _diffusers_layout(2, 3, 37, 16)
    args = _args(name, q, k, v, lse)
    bound = bind(op, args, {})
    assert needs_lse(bound) == lse
    out, ref_lse = exact(AttentionCall(q, k, v, need_lse=True))
    layout = OutputLayout(op)
    packed = layout.pack(bound, args, {}, out, ref_lse)
    meta = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert len(packed) == len(meta)
    for i, (got, want) in enumerate(zip(packed, meta)):
        if name == "_scaled_dot_product_cudnn_attention" and i == 1 and not lse:
            assert got is None  # cuDNN's real kernel returns no log-sum-exp (its meta kernel does)
        elif isinstance(want, torch.Tensor):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), (i, got, want)
        else:
            assert got == want
    assert torch.equal(packed[0], out)
    if lse:
        # (batch, heads, queries) wherever the op keeps it (cuDNN adds a dim, memory-efficient pads)
        _, got_lse = layout.unpack(bound, packed)
        assert torch.equal(got_lse, ref_lse)


def test_cpu_kernel_with_a_stand_in_gives_the_aten_ops_values():
    served = []
    set_selector(Selector([standin("ours", exact, calls=served)], timer=fixed_times({SDPA: 1.0, "ours": 0.5})))
    op = OPS["_scaled_dot_product_flash_attention_for_cpu"]
    kernel = inference_kernel(op)
    for causal in (False, True):
        q, k, v = _diffusers_layout(1, 4, 50, 32, seed=int(causal))
        got = kernel(q, k, v, 0.0, causal)
        want = op(q, k, v, 0.0, causal)
        assert served and served[-1][2] is True
        for g, w in zip(got, want):
            assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        assert ((got[0].float() - want[0].float()).norm() / want[0].float().norm()) < 1e-2
        assert (got[1] - want[1]).abs().max() < 1e-2
    # an empty head shard, a mask: the aten op runs (no candidate sees them)
    served.clear()
    q, k, v = _diffusers_layout(1, 4, 50, 32)
    empty = [t[:, :0] for t in (q, k, v)]
    assert kernel(*empty)[0].shape == (1, 0, 50, 32)
    mask = torch.zeros(50, 50, dtype=torch.bfloat16).masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), -1e4)
    with pytest.warns(RuntimeWarning, match="a mask/bias -> SDPA"):
        assert torch.equal(kernel(q, k, v, attn_mask=mask)[0], op(q, k, v, attn_mask=mask)[0])
    assert served == []
