"""The SD3 family: diffusers' ``SD3Transformer2DModel`` (MMDiT), the class unmodified.

Tensor parallel (``"tp"``) over heads and MLP features, in every ``JointTransformerBlock``:
``attn.to_q/k/v`` and ``attn.add_q/k/v_proj`` colwise, ``attn.to_out.0`` and ``attn.to_add_out``
rowwise, ``ff``/``ff_context`` ``net.0.proj`` colwise and ``net.2`` rowwise; SD3.5's second
(image-only) attention ``attn2`` likewise. The last block is ``context_pre_only`` (no
``to_add_out``, no ``ff_context``): the plan is built per block from the modules it has.
q/k RMSNorms (``qk_norm``) run on head shards over head_dim, which is never sharded. The adaLN
modulation Linears, ``pos_embed``, ``time_text_embed``, ``context_embedder``, ``norm_out`` and
``proj_out`` stay replicated.

Sequence parallel (``"sp"``, Ulysses): the model takes latents as (batch, C, H, W), so the
sequence is sharded where tokens first exist: forward hooks on ``pos_embed`` and
``context_embedder`` lay their outputs out as Shard(1) on "sp" (a local slice of replicated
values). Attention runs through ``DtorchSD3AttnProcessor`` (installed with diffusers'
``set_attn_processor``), which computes diffusers' JointAttnProcessor2_0 with Flux's Ulysses
moves: q/k/v of each stream go from sequence shards to head shards (an all-to-all), SDPA runs
on the whole joint image+text sequence, and each stream's output goes back to sequence shards.
``proj_out``'s output is gathered on "sp" (a forward hook) before the unpatchify reshape.

Batch (``"cfg"``, ``"dp"``): the inputs with a batch dim (``BATCH_INPUTS``) enter the model
split on it (Shard(0)): in StableDiffusion3Pipeline's classifier-free guidance the
unconditional and conditional halves of the batch run on different devices.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard

from ..batch import lay_out
from ..family import ModelFamily
from ..blocks import one_op_blocks
from ..joint import joint_heads, stream_outputs
from ..modulate import one_op_modulation
from ..rms_norm import one_op_rms_norms
from ..ring import ring_attention, ring_mesh_dim
from ..timesteps import one_op_timesteps
from .flux import HEADS, SEQ, _move, _sp_dims, sp_mesh_dim

# the inputs with a batch dim, split over "cfg" and "dp" where they enter the model
BATCH_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
_HOOKED = "_dtorch_sd3_sp_hook"


def _heads(attn, x):
    # diffusers' legacy Attention has no head_dim attribute; DTensor shapes are global
    return x.unflatten(-1, (attn.heads, -1))


def _norm(norm, x):
    return x if norm is None else norm(x)


class DtorchSD3AttnProcessor:
    """diffusers' JointAttnProcessor2_0 (non-fused projections, no IP adapter, no mask), with
    Ulysses: q, k and v go from sequence shards to head shards before the joint attention, and
    each stream's output back to sequence shards; with sp_mode="ring", ring attention on the
    sequence shards instead (dtorch_hf/ring.py). Without an "sp" dim it is JointAttnProcessor2_0
    itself (computed in the (batch, seq, heads, head_dim) layout)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if getattr(attn, "fused_projections", False):
            raise NotImplementedError("dtorch's SD3 attention does not serve fused qkv projections; unfuse them")
        if attention_mask is not None:
            raise NotImplementedError("dtorch's SD3 attention does not take an attention_mask "
                                      "(JointAttnProcessor2_0 ignores it too)")
        query = _norm(attn.norm_q, _heads(attn, attn.to_q(hidden_states)))
        key = _norm(attn.norm_k, _heads(attn, attn.to_k(hidden_states)))
        value = _heads(attn, attn.to_v(hidden_states))
        ring_dim = ring_mesh_dim(attn, query)
        if ring_dim is not None:
            return _ring_sd3(attn, query, key, value, encoder_hidden_states, ring_dim)
        img_seq = bool(_sp_dims(query)) and Shard(SEQ) in query.placements
        streams = [tuple(_move(t, SEQ, HEADS) for t in (query, key, value))]
        txt_seq = False
        if encoder_hidden_states is not None:
            eq = _norm(attn.norm_added_q, _heads(attn, attn.add_q_proj(encoder_hidden_states)))
            ek = _norm(attn.norm_added_k, _heads(attn, attn.add_k_proj(encoder_hidden_states)))
            ev = _heads(attn, attn.add_v_proj(encoder_hidden_states))
            txt_seq = bool(_sp_dims(eq)) and Shard(SEQ) in eq.placements
            streams.append(tuple(_move(t, SEQ, HEADS) for t in (eq, ek, ev)))
        # image first, then text (JointAttnProcessor2_0's order; Flux's is the reverse)
        q, k, v = joint_heads(*(list(ts) for ts in zip(*streams)))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        # split the joint sequence while it is whole (head-sharded)
        outs = stream_outputs(out, [s[0].shape[SEQ] for s in streams])
        out, enc = outs if len(outs) == 2 else (outs[0], None)
        dtype = query.dtype
        if enc is not None:
            if txt_seq:
                enc = _move(enc, HEADS, SEQ)
            enc = enc.flatten(2, 3).to(dtype).contiguous()
            if not attn.context_pre_only:
                enc = attn.to_add_out(enc)
        if img_seq:
            out = _move(out, HEADS, SEQ)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(dtype).contiguous()))
        return out if enc is None else (out, enc)


def _ring_sd3(attn, query, key, value, encoder_hidden_states, ring_dim):
    """JointAttnProcessor2_0's attention as ring attention: each stream stays on its sequence
    shards, the image and text streams attend jointly."""
    streams = [(query, key, value)]
    if encoder_hidden_states is not None:
        eq = _norm(attn.norm_added_q, _heads(attn, attn.add_q_proj(encoder_hidden_states)))
        ek = _norm(attn.norm_added_k, _heads(attn, attn.add_k_proj(encoder_hidden_states)))
        ev = _heads(attn, attn.add_v_proj(encoder_hidden_states))
        streams.append((eq, ek, ev))
    outs = ring_attention(*(list(ts) for ts in zip(*streams)), ring_dim)
    dtype = query.dtype
    out = attn.to_out[1](attn.to_out[0](outs[0].flatten(2, 3).to(dtype).contiguous()))
    if encoder_hidden_states is None:
        return out
    enc = outs[1].flatten(2, 3).to(dtype).contiguous()
    return out, (enc if attn.context_pre_only else attn.to_add_out(enc))


def _shard_tokens(model):
    """A forward hook laying a (batch, tokens, features) output out as Shard(1) on "sp"."""

    def hook(module, args, output):
        mesh, dim = sp_mesh_dim(model.proj_out.weight)
        if mesh is None or not isinstance(output, torch.Tensor) or output.ndim != 3:
            return output
        return lay_out(output, mesh, {dim: Shard(SEQ)})

    return hook


def _gather_tokens(module, args, output):
    # the unpatchify reshape splits the token dim into (h, w): gather the sequence first
    dims = [i for i in _sp_dims(output) if output.placements[i] == Shard(SEQ)]
    if not dims:
        return output
    wanted = list(output.placements)
    for i in dims:
        wanted[i] = Replicate()
    return output.redistribute(output.device_mesh, wanted)


def prepare(model: nn.Module) -> None:
    """Install dtorch's attention processor and the sequence-parallel hooks (once)."""
    if getattr(model, _HOOKED, False):
        return
    model.set_attn_processor(DtorchSD3AttnProcessor())
    model.pos_embed.register_forward_hook(_shard_tokens(model))
    model.context_embedder.register_forward_hook(_shard_tokens(model))
    model.proj_out.register_forward_hook(_gather_tokens)
    one_op_timesteps(model, lambda: model.proj_out.weight)
    one_op_modulation(model)
    one_op_blocks(model)
    one_op_rms_norms(model)
    setattr(model, _HOOKED, True)


def sd3_tp_plan(model: nn.Module) -> dict:
    """The tp plan of an SD3Transformer2DModel, per block (the context_pre_only last block has
    no to_add_out/ff_context). (It also installs the Ulysses attention processor and the "sp"
    hooks: the family's only call at parallelize time.)"""
    prepare(model)
    colwise, rowwise = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    plan = {}
    for i, block in enumerate(model.transformer_blocks):
        b = f"transformer_blocks.{i}"
        for name in ("attn", "attn2"):
            attn = getattr(block, name, None)
            if attn is None:
                continue
            for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                if getattr(attn, proj, None) is not None:
                    plan[f"{b}.{name}.{proj}"] = colwise()
            plan[f"{b}.{name}.to_out.0"] = rowwise()
            if getattr(attn, "to_add_out", None) is not None:
                plan[f"{b}.{name}.to_add_out"] = rowwise()
        for ff in ("ff", "ff_context"):
            if getattr(block, ff, None) is not None:
                plan[f"{b}.{ff}.net.0.proj"] = colwise()
                plan[f"{b}.{ff}.net.2"] = rowwise()
    return plan


SD3_FAMILY = ModelFamily(
    name="sd3",
    model_classes=("SD3Transformer2DModel",),
    dims=frozenset({"tp", "sp", "cfg", "dp"}),
    tp_plan=sd3_tp_plan,
    batch_kwargs=BATCH_INPUTS,
    sp_modes=("ulysses", "ring"),
)
