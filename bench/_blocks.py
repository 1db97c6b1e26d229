"""Standard transformer blocks for bench/model_steps.py and the op-parity tests, in plain torch.

Each family is a small model built from the pieces real models use (not only Linear + GELU):
- ``llama``: embedding, RMSNorm, fused qkv Linear, causal SDPA, SwiGLU MLP, float32 cross-entropy
- ``gpt2``: learned positions, LayerNorm, biased Linears, causal SDPA, GELU-tanh MLP
- ``t5``: T5's RMS layer norm, relative position bias (bucketed, per head) added to the scores,
  gated-GELU MLP, cross-entropy
- ``dit``: adaLN modulation from a conditioning vector, RoPE, joint text+image attention,
  non-affine LayerNorm, GELU-tanh MLP, MSE loss (a Flux/SD3-style block)

``make(family, size)`` returns ``(model, batch_fn, loss_fn)``: ``batch_fn(seed)`` builds a batch
of plain tensors and ``loss_fn(model, batch)`` the scalar loss. Sizes: ``tiny`` (tests), ``small``
(overhead-bound) and ``large`` (compute-bound on one GPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    # family: {size: dict(d, heads, layers, seq, batch, vocab)}
    "llama": {"tiny": dict(d=32, heads=4, layers=1, seq=8, batch=2, vocab=64),
              "small": dict(d=256, heads=4, layers=2, seq=128, batch=4, vocab=4096),
              "large": dict(d=2048, heads=16, layers=4, seq=2048, batch=4, vocab=32000)},
    "gpt2": {"tiny": dict(d=32, heads=4, layers=1, seq=8, batch=2, vocab=64),
             "small": dict(d=256, heads=4, layers=2, seq=128, batch=4, vocab=4096),
             "large": dict(d=1600, heads=25, layers=4, seq=1024, batch=8, vocab=50304)},
    "t5": {"tiny": dict(d=32, heads=4, layers=1, seq=8, batch=2, vocab=64),
           "small": dict(d=256, heads=4, layers=2, seq=128, batch=4, vocab=4096),
           "large": dict(d=2048, heads=32, layers=4, seq=512, batch=16, vocab=32128)},
    "dit": {"tiny": dict(d=32, heads=4, layers=1, seq=8, batch=2, text=4),
            "small": dict(d=256, heads=4, layers=2, seq=256, batch=2, text=64),
            "large": dict(d=3072, heads=24, layers=2, seq=4096, batch=1, text=512)},
}
FAMILIES = tuple(SIZES)


def rms_norm(d):
    return nn.RMSNorm(d, eps=1e-6)


class Attention(nn.Module):
    """Self-attention with one fused qkv projection; ``bias`` is added to the scores."""

    def __init__(self, d, heads, *, bias=False):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)

    def forward(self, x, *, causal=False, score_bias=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=score_bias, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class LlamaLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn_norm, self.mlp_norm = rms_norm(d), rms_norm(d)
        self.attn = Attention(d, heads)
        hidden = 8 * d // 3
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x), causal=True)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT2Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, bias=True)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x), causal=True)
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class T5LayerNorm(nn.Module):
    """T5's norm: scale by the root mean square, no mean subtraction, no bias (float32 inside)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


class T5Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = T5LayerNorm(d), T5LayerNorm(d)
        self.attn = Attention(d, heads)
        self.wi = nn.Linear(d, 2 * (5 * d // 2), bias=False)
        self.wo = nn.Linear(5 * d // 2, d, bias=False)

    def forward(self, x, position_bias):
        x = x + self.attn(self.norm1(x), score_bias=position_bias)
        gate, lin = self.wi(self.norm2(x)).chunk(2, dim=-1)
        return x + self.wo(F.gelu(gate, approximate="tanh") * lin)


def relative_buckets(seq, num_buckets=32, max_distance=128):
    """T5's bidirectional relative-position buckets for a ``seq x seq`` score matrix."""
    pos = torch.arange(seq)
    rel = pos[None, :] - pos[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return buckets + torch.where(rel < exact, rel, large.clamp(max=half - 1))


class LanguageModel(nn.Module):
    """Decoder or encoder stack with a vocabulary head (llama, gpt2, t5)."""

    def __init__(self, family, d, heads, layers, seq, vocab, **_):
        super().__init__()
        self.family = family
        self.embed = nn.Embedding(vocab, d)
        if family == "gpt2":
            self.positions = nn.Embedding(seq, d)
        if family == "t5":
            self.bias_table = nn.Embedding(32, heads)
            self.register_buffer("buckets", relative_buckets(seq), persistent=False)
        layer = {"llama": LlamaLayer, "gpt2": GPT2Layer, "t5": T5Layer}[family]
        self.layers = nn.ModuleList(layer(d, heads) for _ in range(layers))
        self.norm = {"llama": rms_norm, "gpt2": nn.LayerNorm, "t5": T5LayerNorm}[family](d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.family == "gpt2":
            x = x + self.positions.weight[: tokens.shape[1]]
        extra = {}
        if self.family == "t5":
            bias = self.bias_table(self.buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, S, S]
            extra = {"position_bias": bias.to(x.dtype)}
        for layer in self.layers:
            x = layer(x, **extra)
        return self.head(self.norm(x))


def rope(x, cos, sin):
    """Rotate pairs of features (``x`` is ``[B, H, S, E]``; ``cos``/``sin`` are ``[S, E/2]``)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rope_tables(seq, dim, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


class DiTLayer(nn.Module):
    """A joint (text + image) transformer block with adaLN-zero modulation and RoPE."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.modulation = nn.Linear(d, 12 * d)  # shift/scale/gate for attention and MLP, per stream
        self.img_qkv, self.txt_qkv = nn.Linear(d, 3 * d), nn.Linear(d, 3 * d)
        self.img_out, self.txt_out = nn.Linear(d, d), nn.Linear(d, d)
        self.img_mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.txt_mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, img, txt, cond, cos, sin):
        b, s_img, d = img.shape
        s_txt = txt.shape[1]
        mods = self.modulation(F.silu(cond)).unsqueeze(1).chunk(12, dim=-1)
        (i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2,
         t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2) = mods

        def modulate(x, shift, scale):
            return F.layer_norm(x, (d,)) * (1 + scale) + shift

        def heads(qkv, s):
            return qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)

        qi, ki, vi = heads(self.img_qkv(modulate(img, i_shift, i_scale)), s_img)
        qt, kt, vt = heads(self.txt_qkv(modulate(txt, t_shift, t_scale)), s_txt)
        q = rope(torch.cat((qt, qi), dim=2), cos, sin)
        k = rope(torch.cat((kt, ki), dim=2), cos, sin)
        v = torch.cat((vt, vi), dim=2)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s_txt + s_img, d)
        txt = txt + t_gate * self.txt_out(y[:, :s_txt])
        img = img + i_gate * self.img_out(y[:, s_txt:])
        img = img + i_gate2 * self.img_mlp(modulate(img, i_shift2, i_scale2))
        txt = txt + t_gate2 * self.txt_mlp(modulate(txt, t_shift2, t_scale2))
        return img, txt


class DiT(nn.Module):
    def __init__(self, d, heads, layers, seq, text, **_):
        super().__init__()
        self.layers = nn.ModuleList(DiTLayer(d, heads) for _ in range(layers))
        cos, sin = rope_tables(seq + text, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.final = nn.Linear(d, d)

    def forward(self, img, txt, cond):
        for layer in self.layers:
            img, txt = layer(img, txt, cond, self.cos, self.sin)
        return self.final(F.layer_norm(img, (img.shape[-1],)))


def make(family: str, size: str, *, dtype=torch.float32, device="cpu"):
    """``(model, batch_fn, loss_fn)`` for ``family`` at ``size`` (see the module docstring)."""
    cfg = SIZES[family][size]
    if family == "dit":
        model = DiT(**cfg)
    else:
        model = LanguageModel(family, **cfg)
    model = model.to(device=device, dtype=dtype)

    def batch_fn(seed: int):
        gen = torch.Generator().manual_seed(seed)
        b, s, d = cfg["batch"], cfg["seq"], cfg["d"]
        if family == "dit":
            img = torch.randn(b, s, d, generator=gen)
            txt = torch.randn(b, cfg["text"], d, generator=gen)
            cond = torch.randn(b, d, generator=gen)
            target = torch.randn(b, s, d, generator=gen)
            return tuple(t.to(device=device, dtype=dtype) for t in (img, txt, cond, target))
        tokens = torch.randint(0, cfg["vocab"], (b, s + 1), generator=gen)
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    def loss_fn(model, batch):
        if family == "dit":
            img, txt, cond, target = batch
            return F.mse_loss(model(img, txt, cond).float(), target.float())
        tokens, targets = batch
        logits = model(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return model, batch_fn, loss_fn
