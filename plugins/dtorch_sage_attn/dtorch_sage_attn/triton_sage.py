"""Our SageAttention-2-style attention kernel in Triton, tuned for Hopper (inference only).

The recipe (SageAttention, SageAttention2 papers): K smoothed (its mean over the sequence
subtracted; softmax does not change) and quantised to INT8 per block of keys (or per key:
``k_token``); Q quantised to INT8 per query row inside the attention kernel, with the softmax
scale and log2(e) folded into its scale; QK^T as an INT8 dot with int32 accumulation; online
softmax in fp32 with exp2; P (scaled by 448 to fill e4m3) and V (mean subtracted, scaled per
channel) in FP8 e4m3 for the PV dot with fp32 accumulation; the scales, V's mean and 1/l applied
once at the end. With ``pv16`` P.V runs in the inputs' 16-bit type instead (P rounded to it, V
read as it is through TMA, not quantised): half the FP8 MMA rate, but e4m3's 3 mantissa bits
cost about 2.5% relative L1 each for P and V where the output is noise-like (i.i.d. inputs).

    sage_attention(q, k, v, causal=False, scale=None, return_lse=False)
    unsupported_reason(q, k, v, causal=..., attn_mask=..., dropout_p=...) -> str | None

No host syncs and no allocation outside torch's caching allocator (output and scratch), so it can
be captured in a CUDA graph. Launch configurations are fixed per (head dim, causal) (see
_CONFIGS; bench/attention.py --sweep times the candidates);
DTORCH_SAGE_CONFIG="BM,BN,warps,stages[,fused_acc[,pv16[,k_token[,max_regs[,gluon]]]]]" overrides
them; ``gluon`` picks the Gluon rewrite (gluon_sage.py) where the GPU is sm_90 and Gluon imports.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs; unsupported_reason says so
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_DTYPES = (torch.float16, torch.bfloat16)


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fused_acc: int = 0  # 1: P.V accumulates in the MMA's accumulator (faster, less precise)
    pv16: int = 0  # 1: P.V in the inputs' 16-bit dtype, V unquantised (else FP8 e4m3)
    k_token: int = 0  # 1: one INT8 scale per key (one more multiply per score), else per block
    max_regs: int = 0  # >0: register cap per thread (ptxas maxnreg): more CTAs an SM
    gluon: int = 0  # 1: the Gluon kernel (gluon_sage: sm_90 only, FP8 P.V, no pv16 or k_token)


# (head_dim, causal) -> launch config: 64 query rows, 128 keys a step, one warpgroup (4 warps)
# a CTA, FP8 P.V. Measured on one H200 (bench/attention.py --sweep, 2026-12-02, two runs:
# bench/results/2026-12-02-h200/): at D=128 two TMA stages with registers capped at 168 (ptxas
# then spills some accumulator registers, inside the loop too) fit three CTAs an SM and beat the
# uncapped two: Flux 0.466 / 0.464 ms (0.86x the sweep's SDPA, 0.400 / 0.398 ms) against
# 0.493 / 0.497 for (64, 128, 4, 3); the causal GQA prefill 3.166 / 3.199 ms (1.23x / 1.20x)
# against 3.254 / 3.275. At D=64 (SD3) the configs tie within noise: fused accumulation, 3
# stages, 0.596 / 0.592 ms (0.98x / 0.99x) against 0.600 / 0.597 (a 168-register cap: 0.592).
# No D=64 causal shape was timed: it keeps the old default. The 16-bit P.V variant (pv16,
# k_token), the only one that passes the gate on i.i.d. randn (relative L1 0.9% against FP8's
# 3.9%), ran 25-35% slower at D=128 and 14% at D=64, so it is not the default.
_CONFIGS = {
    (64, False): LaunchConfig(64, 128, 4, 3, 1),
    (64, True): LaunchConfig(64, 128, 4, 3),
    (128, False): LaunchConfig(64, 128, 4, 2, max_regs=168),
    (128, True): LaunchConfig(64, 128, 4, 2, max_regs=168),
}


# The Gluon kernel's config (gluon_sage.py, sm_90). No default uses it: on one H100 (2026-12-08)
# it ran 0.72x / 0.73x / 1.04x SDPA at Flux / SD3 / the causal prefill, the Triton kernel 0.88x /
# 0.97x / 1.18x (bench/results/2026-12-08-h100-gluon/)
GLUON_CONFIG = LaunchConfig(64, 128, 4, 2, 1, gluon=1)


def launch_config(head_dim: int, causal: bool) -> LaunchConfig:
    forced = os.environ.get("DTORCH_SAGE_CONFIG")
    if forced:
        return LaunchConfig(*(int(x) for x in forced.split(",")))
    return _CONFIGS[(head_dim, causal)]


def unsupported_reason(q, k, v, *, causal, attn_mask, dropout_p) -> str | None:
    """Why this kernel cannot serve the call, or None when it can."""
    if triton is None:
        return "triton is not installed"
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "q, k and v must be tensors"
    if attn_mask is not None:
        return "attention masks are not supported"
    if dropout_p:
        return "dropout is not supported"
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return "inputs need gradients (this kernel has no backward)"
    if any(t.dtype not in _DTYPES for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype}: needs float16 or bfloat16, all the same"
    if any(t.dim() != 4 for t in tensors):
        return "needs 4-D (batch, heads, seq, head_dim) inputs"
    if len({t.device for t in tensors}) != 1:
        return "q, k and v are on different devices"
    batch, hq, sq, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        return f"shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} do not match"
    if dim not in (64, 128):
        return f"head_dim {dim}: needs 64 or 128"
    if k.shape[1] == 0 or hq % k.shape[1]:
        return f"{hq} query heads are not a multiple of {k.shape[1]} kv heads"
    if sq == 0 or k.shape[2] == 0 or batch == 0 or hq == 0:
        return "empty input"
    if causal and sq != k.shape[2]:
        return "causal needs equal query and key lengths"
    if q.device.type != "cuda" and not (_INTERPRET and q.device.type == "cpu"):
        return f"device {q.device.type}: needs CUDA"
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 9):
        return "needs FP8 tensor cores (compute capability 8.9 or newer)"
    return None


if triton is not None:
    from .triton_quant import (
        SEQ_PAD,
        quantize_kv,
        round_to_e4m3,
    )

    _LN2 = tl.constexpr(LN2)

    _LOG2_FP8_MAX = tl.constexpr(math.log2(448.0))

    @triton.jit
    def _attn_blocks(acc, l_i, m_i, q_i8, q_step, k_desc, k_row, ks_ptr, v_desc, v_row, v_head,
                     offs_m, lo, hi,
                     Sk, D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                     INTERPRETER: tl.constexpr, FUSED_ACC: tl.constexpr, PV16: tl.constexpr,
                     K_TOKEN: tl.constexpr):
        """Keys [lo, hi): MASK 0 none, 1 keys >= Sk, 2 causal (key > query).

        m_i is in log2 units of the scaled scores; P comes out of exp2 already times 448 (the
        e4m3 range), and l_i sums that same P, so the factor cancels in acc / l_i. q_step is
        per query row; the K scale per block of keys (or per key with K_TOKEN).
        """
        offs_n = tl.arange(0, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            k = k_desc.load([k_row + start_n, 0])  # (BLOCK_N, D) int8 through TMA, zero past Sk
            s = tl.dot(q_i8, k.T).to(tl.float32)  # exact (|score| < 2**24); I2FP on sm_90
            if K_TOKEN:  # one scale per key: a multiply per score
                s = s * tl.load(ks_ptr + start_n + offs_n)[None, :]
                c = q_step
            else:  # one scale per block of keys, folded with Q's row scale
                c = q_step * tl.load(ks_ptr + start_n // BLOCK_N)
            if MASK == 1:
                s = tl.where((start_n + offs_n < Sk)[None, :], s, float("-inf"))
            elif MASK == 2:
                s = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            p = tl.math.exp2(s * c[:, None] - (m_new - _LOG2_FP8_MAX)[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if PV16:  # V (BLOCK_N, D) as the caller gave it (4-D descriptor, zero past Sk)
                v = v_desc.load([v_row, v_head, start_n, 0]).reshape(BLOCK_N, D)
                if INTERPRETER:  # Triton 3.6's interpreter multiplies bf16 bits as integers
                    acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                 acc * alpha[:, None])
                else:
                    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            else:
                vt = v_desc.load([v_row, start_n])  # (D, BLOCK_N) fp8: K-major B operand
                if INTERPRETER:  # its cast to e4m3 drops the carry into the exponent
                    p = round_to_e4m3(p)
                if FUSED_ACC:  # one accumulator, fed to the MMA (the tensor core's FP8 precision)
                    acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc * alpha[:, None])
                else:  # two-level: each block's P.V in a fresh fp32 accumulator, added here
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), tl.trans(vt))
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _sage_attn_kernel(Q, KDesc, KScale, VDesc, HeadStats, Out, Lse,
                          stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                          Hq, Hkv, Sq, Sk, Sk_pad, qk_scale, sm_scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr,
                          INTERPRETER: tl.constexpr, FUSED_ACC: tl.constexpr,
                          PV16: tl.constexpr, K_TOKEN: tl.constexpr):
        pid_m = tl.program_id(0)
        if CAUSAL:  # the longest rows first, so the short ones fill the tail
            pid_m = tl.num_programs(0) - 1 - pid_m
        head = tl.program_id(1)
        batch = tl.program_id(2)
        kv_bh = (batch * Hkv + head // (Hq // Hkv)).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = (offs_m < Sq)[:, None]

        q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                    + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok, other=0.0)
        q = q.to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-20)  # one INT8 scale per query row
        q_i8 = q * (127.0 / q_amax)[:, None]
        q_i8 = (q_i8 + tl.where(q_i8 >= 0, 0.5, -0.5)).to(tl.int8)
        q_step = q_amax / 127.0 * qk_scale  # scores in log2 units

        # K (B*Hkv*Sk_pad, D) and V^T (B*Hkv*D, Sk_pad) fp8, or V (B, Hkv, Sk, D) as given
        # (PV16), come through TMA descriptors: no per-element pointers held across the loop
        k_row = (kv_bh * Sk_pad).to(tl.int32)
        if PV16:
            v_row, v_head = batch, head // (Hq // Hkv)
        else:
            v_row, v_head = (kv_bh * D).to(tl.int32), 0
        if K_TOKEN:
            ks_ptr = KScale + kv_bh * Sk_pad
        else:
            ks_ptr = KScale + kv_bh * (Sk_pad // BLOCK_N)

        stats = HeadStats + kv_bh * (3 * D) + offs_d
        if RETURN_LSE:  # the scores are of K - mean(K): q . mean(K) goes back into the lse
            lse_shift = tl.sum(q * tl.load(stats)[None, :], 1) * sm_scale

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if CAUSAL:
            # key blocks wholly left of this query block's first row need no mask (BLOCK_N may
            # be larger than BLOCK_M: round down); the rest up to its last row are masked
            mask_from = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
            end, tail_mask = (pid_m + 1) * BLOCK_M, 2  # <= Sk_pad; keys past Sk are zeros
        else:
            mask_from = (Sk // BLOCK_N) * BLOCK_N
            end, tail_mask = tl.cdiv(Sk, BLOCK_N) * BLOCK_N, 1
        acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q_i8, q_step, KDesc, k_row, ks_ptr, VDesc,
                                     v_row, v_head, offs_m, 0, mask_from, Sk, D, BLOCK_N, 0,
                                     INTERPRETER, FUSED_ACC, PV16, K_TOKEN)
        acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q_i8, q_step, KDesc, k_row, ks_ptr, VDesc,
                                     v_row, v_head, offs_m, mask_from, end, Sk, D, BLOCK_N,
                                     tail_mask, INTERPRETER, FUSED_ACC, PV16, K_TOKEN)

        if PV16:  # V was not shifted or scaled
            out = acc * (1.0 / l_i)[:, None]
        else:
            v_mean = tl.load(stats + D)
            v_scale = tl.load(stats + 2 * D)  # V's per-channel scale (P's 448 cancels in acc / l)
            out = acc * (1.0 / l_i)[:, None] * v_scale[None, :] + v_mean[None, :]
        tl.store(Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                 + offs_m[:, None] * stride_om + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok)
        if RETURN_LSE:
            lse = (m_i + tl.math.log2(l_i) - _LOG2_FP8_MAX) * _LN2 + lse_shift
            tl.store(Lse + (batch * Hq + head).to(tl.int64) * Sq + offs_m, lse,
                     mask=offs_m < Sq)


def gluon_serves(q, config: LaunchConfig) -> bool:
    """Whether ``config`` asks for the Gluon kernel and it can run here (Hopper, sm_90)."""
    if not config.gluon or config.pv16 or config.k_token or _INTERPRET:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    try:
        from . import gluon_sage  # noqa: F401 - Triton without Gluon (< 3.5) cannot
    except ImportError:
        return False
    return True


def _sage_attention(q, k, v, causal, scale, return_lse, config: LaunchConfig):
    if gluon_serves(q, config):
        from .gluon_sage import gluon_attention

        return gluon_attention(q, k, v, causal, scale, return_lse, config)
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    assert SEQ_PAD % config.block_n == 0
    k_int8, k_scale, vt_fp8, head_stats = quantize_kv(
        k, v, block=config.block_n, quant_v=not config.pv16, k_token=bool(config.k_token))
    out = torch.empty_like(q)  # keeps q's layout (e.g. (B, S, H, D) memory from diffusers)
    lse = (torch.empty((batch, hq, sq), device=q.device, dtype=torch.float32) if return_lse
           else out)
    grid = (triton.cdiv(sq, config.block_m), hq, batch)
    k_desc = TensorDescriptor.from_tensor(k_int8.view(-1, dim), [config.block_n, dim])
    if config.pv16:
        v_desc = _v_descriptor(v, config.block_n)
    else:
        v_desc = TensorDescriptor.from_tensor(vt_fp8.view(-1, vt_fp8.shape[-1]),
                                              [dim, config.block_n])
    extra = {"maxnreg": config.max_regs} if config.max_regs and not _INTERPRET else {}
    _sage_attn_kernel[grid](
        q, k_desc, k_scale, v_desc, head_stats, out, lse,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        hq, hkv, sq, sk, k_int8.shape[2], scale * LOG2E, scale,
        D=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, CAUSAL=causal,
        RETURN_LSE=return_lse, INTERPRETER=_INTERPRET, FUSED_ACC=config.fused_acc,
        PV16=bool(config.pv16), K_TOKEN=bool(config.k_token),
        num_warps=config.num_warps, num_stages=config.num_stages, **extra)
    return (out, lse) if return_lse else out


def _v_descriptor(v, block_n):
    """A 4-D TMA descriptor over V (B, Hkv, Sk, D) with its own strides (e.g. diffusers'
    (B, S, H, D) memory), blocks of (1, 1, block_n, D); rows past Sk read as zeros. TMA wants
    16-byte aligned strides and base: otherwise V is copied."""
    strides = list(v.stride())
    for i in (2, 1, 0):  # a dimension of size 1 may carry any stride
        if v.shape[i] == 1:
            strides[i] = v.shape[i + 1] * strides[i + 1]
    if v.data_ptr() % 16 or any(st <= 0 or (st * v.element_size()) % 16 for st in strides[:3]):
        v, strides = v.contiguous(), None
    return TensorDescriptor(v, list(v.shape), strides or list(v.stride()),
                            [1, 1, block_n, v.shape[-1]])


def sage_attention(q, k, v, *, causal=False, scale=None, return_lse=False, config=None):
    """Attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D); Hq % Hkv == 0 (GQA).

    Returns out (B, Hq, Sq, D) in q's dtype, and with return_lse also lse (B, Hq, Sq) float32:
    the natural-log log-sum-exp of the scaled scores (aten's flash-attention convention).
    Causal masking is top-left aligned (SDPA's is_causal) and needs Sq == Sk. ``config`` (a
    LaunchConfig) replaces the default for (head_dim, causal), e.g. GLUON_CONFIG.
    """
    reason = unsupported_reason(q, k, v, causal=causal, attn_mask=None, dropout_p=0.0)
    if reason is not None:
        raise ValueError(f"sage_attention: {reason}")
    return _sage_attention(q, k, v, causal, scale, return_lse,
                           config or launch_config(q.shape[-1], causal))
