"""The SageAttention-2-style kernel of ``triton_sage`` rewritten in Gluon for Hopper (sm_90).

Same numerics as the Triton kernel's FP8 default (K smoothed and INT8 per block of keys, Q INT8
per row, online softmax in fp32 with exp2, P and V in FP8 e4m3), same pre-pass (``quantize_kv``)
and the same outputs. What differs is the schedule, which plain Triton 3.6 cannot express (it
waits for every wgmma where it is issued, so the tensor cores idle during each softmax):

- K and V^T tiles come through TMA into two slots each, with an mbarrier per slot; K block j+2
  is fetched as soon as QK^T of block j is done, V block j+1 as soon as P.V of block j-1 is.
- Each step issues QK^T of block j and P.V of block j-1 together, waits for the first only,
  computes block j's softmax while P.V runs on the tensor cores, then waits for P.V (FA3's
  intra-warpgroup overlap).

    gluon_attention(q, k, v, causal, scale, return_lse, config) -> out | (out, lse)

Only ``config``'s block_m, block_n, num_warps, fused_acc and max_regs are used (no pv16 or
k_token variant here). Import it only where Gluon exists (Triton >= 3.5).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .triton_quant import SEQ_PAD, quantize_kv
from .triton_sage import _LN2, _LOG2_FP8_MAX, LOG2E


@gluon.jit
def _softmax_step(s_i32, m_i, l_i, c, cols, limit, MASK: gl.constexpr):
    """One key block's online softmax: P (times 448, e4m3's range) and the new running max/sum.

    Scores are INT32 dot products; c (per row) turns them into log2 units. With MASK, columns at
    or past ``limit`` (per row) are left out (keys past Sk; causal: keys after the row)."""
    s = s_i32.to(gl.float32)
    if MASK:
        s = gl.where(cols[None, :] < limit[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * c)
    p = gl.exp2(s * c[:, None] - (m_new - _LOG2_FP8_MAX)[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _as_pv_operand(p, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """P (fp32, the QK^T accumulator's layout) as the FP8 A operand of P.V without moving data
    between threads: the keys are taken in the order each thread already holds them. Within each
    32 keys, key 8j + 2t + e (j < 4, t < 4, e < 2) becomes slot 16(j // 2) + 4t + 2(j % 2) + e,
    and V^T's columns were stored in that order by quantize_kv(permute_v=True)."""
    p8 = p.to(gl.float8e4nv).reshape([BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2])
    p8 = p8.permute((0, 1, 2, 4, 3, 5)).reshape([BLOCK_M, BLOCK_N])
    return gl.convert_layout(p8, p_layout)


@gluon.jit
def _gluon_sage_kernel(Q, k_desc, KScale, v_desc, HeadStats, Out, Lse,
                       stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                       Hq, Hkv, Sq, Sk, Sk_pad, qk_scale, sm_scale,
                       D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, FUSED_ACC: gl.constexpr,
                       Q_SMEM: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest rows first, so the short ones fill the tail
        pid_m = gl.num_programs(0) - 1 - pid_m
    head = gl.program_id(1)
    batch = gl.program_id(2)
    kv_bh = batch * Hkv + head // (Hq // Hkv)

    # Q: one INT8 scale per row, the softmax scale and log2(e) folded into it; into shared memory
    q_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(Q + batch.to(gl.int64) * stride_qb + head.to(gl.int64) * stride_qh
                + q_rows[:, None] * stride_qm + dims[None, :],
                mask=(q_rows < Sq)[:, None], other=0.0).to(gl.float32)
    q_amax = gl.maximum(gl.max(gl.abs(q), axis=1), 1e-20)
    q_f = q * (127.0 / q_amax)[:, None]
    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, D], Q_SMEM)
    q_smem.store((q_f + gl.where(q_f >= 0, 0.5, -0.5)).to(gl.int8))
    q_step = gl.convert_layout(q_amax / 127.0 * qk_scale, s_rows)
    stats = HeadStats + kv_bh.to(gl.int64) * (3 * D)
    if RETURN_LSE:  # the scores are of K - mean(K): q . mean(K) goes back into the lse
        k_mean = gl.load(stats + dims)
        lse_shift = gl.convert_layout(gl.sum(q * k_mean[None, :], axis=1) * sm_scale, o_rows)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, D, BLOCK_N], v_desc.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    k_row = kv_bh * Sk_pad
    v_row = kv_bh * D
    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum((pid_m + 1) * BLOCK_M, Sk), BLOCK_N)
    else:
        n_blocks = gl.cdiv(Sk, BLOCK_N)
    for i in gl.static_range(2):
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes, pred=i < n_blocks)
        tma.async_copy_global_to_shared(k_desc, [k_row + i * BLOCK_N, 0], k_bar.index(i),
                                        k_smem.index(i), pred=i < n_blocks)
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes, pred=i < n_blocks)
        tma.async_copy_global_to_shared(v_desc, [v_row, i * BLOCK_N], v_bar.index(i),
                                        v_smem.index(i), pred=i < n_blocks)

    s_rows_idx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:  # keys at or after this column of a block are masked, per row
        row_end = gl.minimum(s_rows_idx + 1, Sk)
    else:
        row_end = gl.full([BLOCK_M], 0, gl.int32, s_rows) + Sk
    first_masked = gl.minimum(Sk, pid_m * BLOCK_M + 1) if CAUSAL else Sk
    ks_ptr = KScale + kv_bh.to(gl.int64) * (Sk_pad // BLOCK_N)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    o_zero = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)

    # block 0: QK^T and its softmax, nothing to overlap with yet
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes, pred=2 < n_blocks)
    tma.async_copy_global_to_shared(k_desc, [k_row + 2 * BLOCK_N, 0], k_bar.index(0),
                                    k_smem.index(0), pred=2 < n_blocks)
    c = q_step * gl.load(ks_ptr)
    if BLOCK_N > first_masked:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, cols, row_end, True)
    else:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, cols, row_end, False)
    p8 = _as_pv_operand(p, p_layout, BLOCK_M, BLOCK_N)

    for j in range(1, n_blocks):
        slot = j % 2
        prev = 1 - slot
        mbarrier.wait(k_bar.index(slot), (j // 2) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // 2) & 1)
        if FUSED_ACC:  # P.V of block j-1 accumulates in the MMA
            pv_tok = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), acc, is_async=True)
        else:  # into a fresh fp32 accumulator, added below
            pv_tok = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), o_zero,
                                   use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, pred=j + 2 < n_blocks)
        tma.async_copy_global_to_shared(k_desc, [k_row + (j + 2) * BLOCK_N, 0], k_bar.index(slot),
                                        k_smem.index(slot), pred=j + 2 < n_blocks)
        c = q_step * gl.load(ks_ptr + j)
        start_n = j * BLOCK_N
        prev_alpha = alpha
        if start_n + BLOCK_N > first_masked:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, cols, row_end - start_n, True)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, cols, row_end - start_n, False)
        p8_next = _as_pv_operand(p, p_layout, BLOCK_M, BLOCK_N)
        pv = warpgroup_mma_wait(0, deps=(pv_tok, ))
        p8 = p8_next
        mbarrier.expect(v_bar.index(prev), v_desc.block_type.nbytes, pred=j + 1 < n_blocks)
        tma.async_copy_global_to_shared(v_desc, [v_row, (j + 1) * BLOCK_N], v_bar.index(prev),
                                        v_smem.index(prev), pred=j + 1 < n_blocks)
        if FUSED_ACC:
            acc = pv * gl.convert_layout(alpha, o_rows)[:, None]
        else:  # acc is in block j-2's max: one FFMA brings it and P.V of j-1 to j-1's
            acc = acc * gl.convert_layout(prev_alpha, o_rows)[:, None] + pv

    last = (n_blocks - 1) % 2
    mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // 2) & 1)
    if FUSED_ACC:
        pv_tok = warpgroup_mma(p8, v_smem.index(last).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(pv_tok, ))
    else:
        pv_tok = warpgroup_mma(p8, v_smem.index(last).permute((1, 0)), o_zero, use_acc=False,
                               is_async=True)
        pv = warpgroup_mma_wait(0, deps=(pv_tok, ))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None] + pv
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    o_dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    v_mean = gl.load(stats + D + o_dims)
    v_scale = gl.load(stats + 2 * D + o_dims)  # V's per-channel scale (P's 448 cancels)
    l_o = gl.convert_layout(l_i, o_rows)
    out = acc * (1.0 / l_o)[:, None] * v_scale[None, :] + v_mean[None, :]
    o_rows_idx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
    gl.store(Out + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
             + o_rows_idx[:, None] * stride_om + o_dims[None, :],
             out.to(Out.dtype.element_ty), mask=(o_rows_idx < Sq)[:, None])
    if RETURN_LSE:
        m_o = gl.convert_layout(m_i, o_rows)
        lse = (m_o + gl.log2(l_o) - _LOG2_FP8_MAX) * _LN2 + lse_shift
        gl.store(Lse + (batch * Hq + head).to(gl.int64) * Sq + o_rows_idx, lse,
                 mask=o_rows_idx < Sq)


def _layouts(block_m, block_n, dim):
    return (gl.NVMMASharedLayout.get_default_for([block_m, dim], gl.int8),
            gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.int8),
            gl.NVMMASharedLayout.get_default_for([dim, block_n], gl.float8e4nv))


def gluon_attention(q, k, v, causal, scale, return_lse, config):
    """Attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D) on sm_90 (checked by the caller:
    ``triton_sage.unsupported_reason``); returns out (and the natural-log lse with return_lse)."""
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    bm, bn = config.block_m, config.block_n
    assert SEQ_PAD % bn == 0 and config.num_warps == 4, config
    k_int8, k_scale, vt_fp8, head_stats = quantize_kv(k, v, block=bn, permute_v=True)
    out = torch.empty_like(q)
    lse = (torch.empty((batch, hq, sq), device=q.device, dtype=torch.float32) if return_lse
           else out)
    q_smem, k_layout, v_layout = _layouts(bm, bn, dim)
    k_desc = TensorDescriptor.from_tensor(k_int8.view(-1, dim), [bn, dim], k_layout)
    v_desc = TensorDescriptor.from_tensor(vt_fp8.view(-1, vt_fp8.shape[-1]), [dim, bn], v_layout)
    extra = {"maxnreg": config.max_regs} if config.max_regs else {}
    _gluon_sage_kernel[(triton.cdiv(sq, bm), hq, batch)](
        q, k_desc, k_scale, v_desc, head_stats, out, lse,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        hq, hkv, sq, sk, k_int8.shape[2], scale * LOG2E, scale,
        D=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, RETURN_LSE=return_lse,
        FUSED_ACC=bool(config.fused_acc), Q_SMEM=q_smem, num_warps=config.num_warps, **extra)
    return (out, lse) if return_lse else out
