"""The accuracy gate: a candidate's output against SDPA's math in fp32 on the same inputs.

A candidate passes when its output has no NaN/inf, a cosine similarity to the reference of at
least 0.9995 and a relative L1 error (sum |out - ref| / sum |ref|) of at most 1e-2. Where the
call reads the log-sum-exp (ring attention weighs its blocks by exp(lse)), that must be finite
and within 0.1 of the reference's everywhere (natural log: this catches a wrong convention, e.g.
log2, not the INT8 kernels' few hundredths), and — what the ring does with it — the outputs of
the two halves of the keys, merged through their log-sum-exps, must pass the same output gate
against the reference (non-causal calls; a causal block has no such split).
"""

from __future__ import annotations

import math

import attrs
import torch

from .records import AttentionCall, GateResult

MIN_COSINE = 0.9995
MAX_REL_L1 = 1e-2
MAX_LSE_ERR = 0.1
# the reference computes scores in fp32 a few heads at a time: at most this many score elements
# at once (256 MiB), so a long prefill's reference fits beside the model
REFERENCE_SCORE_ELEMENTS = 1 << 26


def reference(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's math in fp32: (out (B, Hq, Sq, D) fp32, lse (B, Hq, Sq) fp32). Causal masks are
    top-left aligned, as SDPA's ``is_causal``; GQA maps query head h to key head h // (Hq / Hkv)."""
    q, k, v = call.q, call.k, call.v
    batch, heads, sq, dim = q.shape
    group = heads // k.shape[1]
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(dim)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=q.device)
    mask = None
    if call.causal:
        mask = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
    step = max(1, REFERENCE_SCORE_ELEMENTS // max(1, sq * k.shape[2]))
    for b in range(batch):
        for h0 in range(0, heads, step):
            hs = range(h0, min(heads, h0 + step))
            kv_heads = [h // group for h in hs]
            qf = q[b, h0:hs.stop].float()
            kf = k[b, kv_heads].float()
            vf = v[b, kv_heads].float()
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            chunk_lse = torch.logsumexp(scores, dim=-1)
            lse[b, h0:hs.stop] = chunk_lse
            out[b, h0:hs.stop] = torch.matmul(torch.exp(scores - chunk_lse.unsqueeze(-1)), vf)
    return out, lse


def check(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor | None,
          ref: tuple[torch.Tensor, torch.Tensor]) -> GateResult:
    """Gate ``out`` (and ``lse`` where the call needs it) against ``ref`` (:func:`reference`)."""
    ref_out, ref_lse = ref
    got = out.float()
    finite = bool(torch.isfinite(got).all())
    if got.shape != ref_out.shape:
        return GateResult(0.0, math.inf, finite, None, False)
    flat, ref_flat = got.reshape(-1), ref_out.reshape(-1)
    cosine = float(torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0, eps=1e-12)) if finite else 0.0
    rel_l1 = float((flat - ref_flat).abs().sum() / ref_flat.abs().sum().clamp_min(1e-30)) if finite else math.inf
    lse_err = None
    passed = finite and cosine >= MIN_COSINE and rel_l1 <= MAX_REL_L1
    if call.need_lse:
        if lse is None or tuple(lse.shape) != tuple(ref_lse.shape):
            return GateResult(cosine, rel_l1, finite, math.inf, False)
        lse_f = lse.float()
        lse_finite = bool(torch.isfinite(lse_f).all())
        lse_err = float((lse_f - ref_lse).abs().max()) if lse_finite and lse_f.numel() else (0.0 if lse_finite else math.inf)
        finite = finite and lse_finite
        passed = passed and lse_finite and lse_err <= MAX_LSE_ERR
    return GateResult(cosine, rel_l1, finite, lse_err, passed)


def check_merged(call: AttentionCall, run, ref: tuple[torch.Tensor, torch.Tensor]) -> GateResult:
    """Run ``run`` (a candidate's ``run``) on each half of the keys and values, merge the two
    outputs through their log-sum-exps as ring attention does, and gate the result."""
    half = call.k.shape[2] // 2
    parts = []
    for sl in (slice(0, half), slice(half, None)):
        part = attrs.evolve(call, k=call.k[:, :, sl], v=call.v[:, :, sl])
        out, lse = run(part)
        if lse is None:
            return GateResult(0.0, math.inf, False, math.inf, False)
        parts.append((out.float(), lse.float()))
    (out_a, lse_a), (out_b, lse_b) = parts
    merged_lse = torch.logaddexp(lse_a, lse_b)
    merged = (out_a * torch.exp(lse_a - merged_lse).unsqueeze(-1)
              + out_b * torch.exp(lse_b - merged_lse).unsqueeze(-1))
    return check(attrs.evolve(call, need_lse=True), merged, merged_lse, ref)
