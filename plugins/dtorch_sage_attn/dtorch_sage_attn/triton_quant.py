"""Preprocessing for the SageAttention-2-style kernel: K smoothing + INT8, V to FP8 (transposed).

Two Triton launches, both memory bound:

1. ``_kv_stats_kernel``: one pass over K (and V) per (batch, kv head, sequence split): partial
   column sums of K and V and V's column max/min, written to a scratch buffer (no atomics, so no
   zero-filled buffer and a deterministic result).
2. ``_kv_quant_kernel``: per block of keys (the attention kernel's BLOCK_N, so that one scale
   covers each (Q block, K block) product): reduces the partials to K's mean, V's
   mean and V's per-channel scale, subtracts K's mean (softmax is invariant to it), quantises the
   block to INT8 with one scale (amax / 127; or one per key, ``k_token``), and writes
   V - mean(V), scaled per channel to fill e4m3's range, as FP8 into a (D, Sk_pad) layout:
   Hopper's FP8 MMA wants its B operand K-major. Without ``quant_v`` (16-bit P.V) V is not read:
   the attention kernel takes it as it is.

Q is quantised inside the attention kernel (each program reads its Q block once).
Buffers come from torch's caching allocator and their sizes depend on shapes only, so the whole
path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEQ_PAD = 128  # K/V scratch is padded (with zeros) to a multiple of the largest BLOCK_N
FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 (float8e4nv) value
_STATS_ROWS = 64  # rows per load in the stats pass


@triton.jit
def round_to_e4m3(x):
    """Round fp32 to the nearest e4m3 value (ties to even) so that the cast after it is exact.

    The cast alone rounds the same way on the GPU; Triton's interpreter drops the carry into the
    exponent (127.5 -> 64), so the tests need this form. Subnormal e4m3 values (< 2**-6 of the
    unit) are left to the cast: they are below 1e-4 of the largest value here.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -(1 << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kv_stats_kernel(K, V, Partial, Sk, rows_per_split,
                     stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                     HKV, NSPLIT, D: tl.constexpr,
                     ROWS: tl.constexpr, QUANT_V: tl.constexpr):
    split = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    offs_d = tl.arange(0, D)
    k_base = K + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    k_sum = tl.zeros([D], dtype=tl.float32)
    v_sum = tl.zeros([D], dtype=tl.float32)
    v_max = tl.full([D], float("-inf"), dtype=tl.float32)
    v_min = tl.full([D], float("inf"), dtype=tl.float32)
    row_start = split * rows_per_split
    for start in range(row_start, row_start + rows_per_split, ROWS):  # a multiple of ROWS
        rows = start + tl.arange(0, ROWS)
        valid = (rows < Sk)[:, None]
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=valid, other=0.0)
        k_sum += tl.sum(k.to(tl.float32), axis=0)
        if QUANT_V:
            v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=valid,
                        other=0.0).to(tl.float32)
            v_sum += tl.sum(v, axis=0)
            v_max = tl.maximum(v_max, tl.max(tl.where(valid, v, float("-inf")), axis=0))
            v_min = tl.minimum(v_min, tl.min(tl.where(valid, v, float("inf")), axis=0))
    out = Partial + ((batch * HKV + head) * NSPLIT + split).to(tl.int64) * (4 * D) + offs_d
    tl.store(out, k_sum)
    tl.store(out + D, v_sum)
    tl.store(out + 2 * D, v_max)
    tl.store(out + 3 * D, v_min)


@triton.jit
def _kv_quant_kernel(K, V, Partial, KInt8, KScale, VtFp8, HeadStats, Sk, Sk_pad,
                     stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                     HKV, NSPLIT, D: tl.constexpr,
                     BLOCK: tl.constexpr, SMOOTH_V: tl.constexpr, QUANT_V: tl.constexpr,
                     K_TOKEN: tl.constexpr, PERMUTE_V: tl.constexpr):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    bh = batch * HKV + head
    offs_d = tl.arange(0, D)
    # K's and V's means and V's range from the partials (NSPLIT is small: a few loads of D floats)
    k_sum = tl.zeros([D], dtype=tl.float32)
    v_sum = tl.zeros([D], dtype=tl.float32)
    v_max = tl.full([D], float("-inf"), dtype=tl.float32)
    v_min = tl.full([D], float("inf"), dtype=tl.float32)
    part = Partial + (bh * NSPLIT).to(tl.int64) * (4 * D) + offs_d
    for s in range(NSPLIT):
        k_sum += tl.load(part + s * 4 * D)
        v_sum += tl.load(part + s * 4 * D + D)
        v_max = tl.maximum(v_max, tl.load(part + s * 4 * D + 2 * D))
        v_min = tl.minimum(v_min, tl.load(part + s * 4 * D + 3 * D))
    k_mean = k_sum / Sk
    if SMOOTH_V and QUANT_V:
        v_mean = v_sum / Sk
    else:
        v_mean = tl.zeros([D], dtype=tl.float32)
    if QUANT_V:
        v_range = tl.maximum(tl.maximum(v_max - v_mean, v_mean - v_min), 1e-20)
        v_scale = v_range / FP8_MAX  # V - mean = v_fp8 * v_scale
    else:  # V is used as it is
        v_scale = tl.full([D], 1.0, dtype=tl.float32)
    if blk == 0:
        stats = HeadStats + bh.to(tl.int64) * (3 * D) + offs_d
        tl.store(stats, k_mean)
        tl.store(stats + D, v_mean)
        tl.store(stats + 2 * D, v_scale)

    rows = blk * BLOCK + tl.arange(0, BLOCK)
    valid = (rows < Sk)[:, None]
    k = tl.load(K + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
                + rows[:, None] * stride_kn + offs_d[None, :], mask=valid, other=0.0)
    k = tl.where(valid, k.to(tl.float32) - k_mean[None, :], 0.0)
    if K_TOKEN:  # one scale per key
        k_step = tl.maximum(tl.max(tl.abs(k), 1), 1e-20) / 127.0
        k_q = k / k_step[:, None]
        tl.store(KScale + bh.to(tl.int64) * Sk_pad + rows, k_step)
    else:
        k_step = tl.maximum(tl.max(tl.abs(k)), 1e-20) / 127.0
        k_q = k / k_step
        tl.store(KScale + bh.to(tl.int64) * (Sk_pad // BLOCK) + blk, k_step)
    k_q = k_q + tl.where(k_q >= 0, 0.5, -0.5)  # round half away from zero; the cast truncates
    tl.store(KInt8 + bh.to(tl.int64) * Sk_pad * D + rows[:, None] * D + offs_d[None, :],
             k_q.to(tl.int8))

    if QUANT_V:
        v = tl.load(V + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
                    + rows[:, None] * stride_vn + offs_d[None, :], mask=valid, other=0.0)
        v = tl.where(valid, (v.to(tl.float32) - v_mean[None, :]) / v_scale[None, :], 0.0)
        v = tl.minimum(tl.maximum(round_to_e4m3(v), -FP8_MAX), FP8_MAX)
        if PERMUTE_V:  # key 8j + 2t + e of each 32 to column 16(j // 2) + 4t + 2(j % 2) + e
            cols = ((rows & -32) | (rows & 16) | ((rows & 6) << 1) | ((rows & 8) >> 2)
                    | (rows & 1))
        else:
            cols = rows
        tl.store(VtFp8 + bh.to(tl.int64) * D * Sk_pad + offs_d[None, :] * Sk_pad + cols[:, None],
                 v.to(VtFp8.dtype.element_ty))


def _stats_splits(batch_heads: int, sk: int) -> int:
    """Sequence splits for the stats pass: enough programs to cover the GPU (shape-only)."""
    want = max(1, triton.cdiv(512, batch_heads))
    return max(1, min(want, triton.cdiv(sk, 4 * _STATS_ROWS)))


def quantize_kv(k: torch.Tensor, v: torch.Tensor, *, block: int, smooth_v: bool = True,
                quant_v: bool = True, k_token: bool = False, permute_v: bool = False):
    """K (B, H, Sk, D) and V (same shape), any strides with the last one 1.

    Returns ``(k_int8 (B, H, Sk_pad, D), k_scale (B, H, Sk_pad // block) fp32 (with k_token
    (B, H, Sk_pad): one per key), vt_fp8 (B, H, D, Sk_pad) float8_e4m3fn (None without quant_v),
    head_stats (B, H, 3, D) fp32)``; head_stats holds K's mean, V's mean (zero when not
    smooth_v or not quant_v) and V's per-channel scale (one without quant_v). Rows past Sk are
    zero. With permute_v, V^T's columns (keys) are stored in the order the Gluon kernel's P
    operand takes them (gluon_sage._as_pv_operand).
    """
    batch, heads, sk, dim = k.shape
    sk_pad = triton.cdiv(sk, SEQ_PAD) * SEQ_PAD
    nsplit = _stats_splits(batch * heads, sk)
    rows_per_split = triton.cdiv(triton.cdiv(sk, nsplit), _STATS_ROWS) * _STATS_ROWS
    nsplit = triton.cdiv(sk, rows_per_split)
    dev = k.device
    partial = torch.empty((batch, heads, nsplit, 4, dim), device=dev, dtype=torch.float32)
    k_int8 = torch.empty((batch, heads, sk_pad, dim), device=dev, dtype=torch.int8)
    k_scale = torch.empty((batch, heads, sk_pad if k_token else sk_pad // block), device=dev,
                          dtype=torch.float32)
    vt_fp8 = (torch.empty((batch, heads, dim, sk_pad), device=dev, dtype=torch.float8_e4m3fn)
              if quant_v else k_int8)  # without quant_v nothing is written there
    head_stats = torch.empty((batch, heads, 3, dim), device=dev, dtype=torch.float32)
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    _kv_stats_kernel[(nsplit, heads, batch)](
        k, v, partial, sk, rows_per_split, *strides,
        HKV=heads, NSPLIT=nsplit, D=dim, ROWS=_STATS_ROWS, QUANT_V=quant_v, num_warps=4)
    _kv_quant_kernel[(sk_pad // block, heads, batch)](
        k, v, partial, k_int8, k_scale, vt_fp8, head_stats, sk, sk_pad, *strides,
        HKV=heads, NSPLIT=nsplit, D=dim, BLOCK=block, SMOOTH_V=smooth_v, QUANT_V=quant_v,
        K_TOKEN=k_token, PERMUTE_V=permute_v, num_warps=4)
    return k_int8, k_scale, (vt_fp8 if quant_v else None), head_stats
