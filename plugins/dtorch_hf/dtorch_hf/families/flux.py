"""The Flux family: diffusers' ``FluxTransformer2DModel``, the class unmodified.

Tensor parallel (``"tp"``) over heads and MLP features: in the double-stream blocks q/k/v and
add_q/k/v_proj colwise, to_out.0 and to_add_out rowwise, each feed-forward's first Linear
colwise and second rowwise; in the single-stream blocks q/k/v and proj_mlp colwise and proj_out
rowwise. proj_out's input is ``cat([attention output, MLP output], dim=-1)`` of two
tp-sharded tensors; DTensor semantics make that concatenation exact (dtorch lays the global
concatenation out again before the rowwise matmul: a redistribution, not an approximation).
norm_q/norm_k (RMSNorm over head_dim) run on head shards: head_dim is never sharded. RoPE and
the adaLN modulation run on whatever shards their inputs have; the modulation Linears stay
replicated.

Sequence parallel (``"sp"``, Ulysses): the image and text hidden states enter the model sharded
on the sequence (Shard(1) on "sp", uneven lengths exact). Attention runs through
``DtorchFluxAttnProcessor`` (installed with diffusers' ``set_attn_processor``), which computes
diffusers' FluxAttnProcessor: q/k/v are redistributed from sequence shards to head shards (an
all-to-all), SDPA runs on whole sequences, and the output is redistributed back to sequence
shards. On a tp x sp mesh the heads end up split over both dims.

Batch (``"cfg"``, ``"dp"``): the inputs with a batch dim (``BATCH_INPUTS``) enter the model
split on it (Shard(0)); with "sp" as well, each batch shard is then split on the sequence.

The family sees neither the mesh nor ``sp_mode`` at parallelize time (``ModelFamily`` has only
``tp_plan(model)``), so the processor and the entry hook read the mesh from the DTensors they
meet at call time: the "sp" dim is found by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Replicate, Shard

from ..batch import lay_out
from ..family import ModelFamily
from ..ring import ring_attention, ring_mesh_dim

# the inputs with a batch dim, split over "cfg" and "dp" where they enter the model
BATCH_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")
SEQ, HEADS = 1, 2          # (batch, sequence, heads, head_dim), diffusers' attention layout
_HOOKED = "_dtorch_flux_sp_hook"


def _sp_dims(x) -> list[int]:
    if not isinstance(x, dt.DTensor):
        return []
    names = x.device_mesh.mesh_dim_names or ()
    return [i for i, n in enumerate(names) if n == "sp" and x.device_mesh.size(i) > 1]


def sp_mesh_dim(weight):
    """(mesh, index of its "sp" dim) of a model's DTensor parameter, or (None, None) where the
    model has no "sp" dim of more than one device: the families read the mesh at call time."""
    if not isinstance(weight, dt.DTensor):
        return None, None
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if "sp" not in names or mesh.size(names.index("sp")) == 1:
        return None, None
    return mesh, names.index("sp")


def _move(x, src: int, dst: int):
    """``x`` with every "sp" mesh dim that shards tensor dim ``src`` sharding ``dst`` instead
    (Ulysses' all-to-all when src/dst are the sequence and heads dims)."""
    dims = [i for i in _sp_dims(x) if x.placements[i] == Shard(src)]
    if not dims:
        return x
    wanted = list(x.placements)
    for i in dims:
        wanted[i] = Shard(dst)
    return x.redistribute(x.device_mesh, wanted)


def _heads(attn, x):
    return x.unflatten(-1, (-1, attn.head_dim))


class DtorchFluxAttnProcessor:
    """diffusers' FluxAttnProcessor (non-fused projections, no IP adapter), with Ulysses: q, k
    and v go from sequence shards to head shards before the joint attention, and its output
    back to sequence shards. With sp_mode="ring" the streams stay on their sequence shards and
    attention runs as ring attention (dtorch_hf/ring.py). Without an "sp" dim it is
    FluxAttnProcessor itself."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if getattr(attn, "fused_projections", False):
            raise NotImplementedError("dtorch's Flux attention does not serve fused qkv projections; unfuse them")
        query = attn.norm_q(_heads(attn, attn.to_q(hidden_states)))
        key = attn.norm_k(_heads(attn, attn.to_k(hidden_states)))
        value = _heads(attn, attn.to_v(hidden_states))
        ring_dim = ring_mesh_dim(attn, query)
        if ring_dim is not None and attention_mask is None:
            return _ring_flux(attn, query, key, value, encoder_hidden_states, image_rotary_emb, ring_dim)
        # which streams were sequence-sharded (restored after attention)
        img_seq = bool(_sp_dims(query)) and Shard(SEQ) in query.placements
        query, key, value = (_move(t, SEQ, HEADS) for t in (query, key, value))
        text_len = None
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            text_len = encoder_hidden_states.shape[1]
            eq = attn.norm_added_q(_heads(attn, attn.add_q_proj(encoder_hidden_states)))
            ek = attn.norm_added_k(_heads(attn, attn.add_k_proj(encoder_hidden_states)))
            ev = _heads(attn, attn.add_v_proj(encoder_hidden_states))
            txt_seq = bool(_sp_dims(eq)) and Shard(SEQ) in eq.placements
            eq, ek, ev = (_move(t, SEQ, HEADS) for t in (eq, ek, ev))
            query = torch.cat([eq, query], dim=1)
            key = torch.cat([ek, key], dim=1)
            value = torch.cat([ev, value], dim=1)
        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2)
        dtype = query.dtype
        if text_len is None:
            if img_seq:
                out = _move(out, HEADS, SEQ)
            return out.flatten(2, 3).to(dtype)
        # split the joint sequence while it is whole (head-sharded), then each stream back to
        # its own sequence shards
        enc, out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        if img_seq:
            out = _move(out, HEADS, SEQ)
        if txt_seq:
            enc = _move(enc, HEADS, SEQ)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(dtype).contiguous()))
        enc = attn.to_add_out(enc.flatten(2, 3).to(dtype).contiguous())
        return out, enc


def _ring_flux(attn, query, key, value, encoder_hidden_states, image_rotary_emb, ring_dim):
    """FluxAttnProcessor's attention as ring attention: each stream stays on its sequence shards
    (RoPE applied per stream with its part of the joint sequence's rotary table: text first)."""
    streams = [(query, key, value)]
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        eq = attn.norm_added_q(_heads(attn, attn.add_q_proj(encoder_hidden_states)))
        ek = attn.norm_added_k(_heads(attn, attn.add_k_proj(encoder_hidden_states)))
        ev = _heads(attn, attn.add_v_proj(encoder_hidden_states))
        streams.insert(0, (eq, ek, ev))
    if image_rotary_emb is not None:
        from diffusers.models.embeddings import apply_rotary_emb

        start, rotated = 0, []
        for q, k, v in streams:
            part = tuple(t[start:start + q.shape[SEQ]] for t in image_rotary_emb)
            start += q.shape[SEQ]
            rotated.append((apply_rotary_emb(q, part, sequence_dim=1), apply_rotary_emb(k, part, sequence_dim=1), v))
        streams = rotated
    outs = ring_attention(*(list(ts) for ts in zip(*streams)), ring_dim)
    dtype = query.dtype
    if len(outs) == 1:
        return outs[0].flatten(2, 3).to(dtype)
    enc, out = outs
    out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(dtype).contiguous()))
    enc = attn.to_add_out(enc.flatten(2, 3).to(dtype).contiguous())
    return out, enc


def _sequence_shard_inputs(model):
    """A forward pre-hook laying ``hidden_states`` and ``encoder_hidden_states`` out as
    Shard(1) on the mesh's "sp" dim (read from the model's DTensor parameters at call time)."""

    def hook(module, args, kwargs):
        mesh, dim = sp_mesh_dim(module.x_embedder.weight)
        if mesh is None:
            return args, kwargs
        wanted = {dim: Shard(SEQ)}

        def shard(value):
            return lay_out(value, mesh, wanted) if isinstance(value, torch.Tensor) and value.ndim == 3 else value

        if args:
            args = (shard(args[0]),) + tuple(args[1:])
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = shard(kwargs["hidden_states"])
        if "encoder_hidden_states" in kwargs:
            kwargs["encoder_hidden_states"] = shard(kwargs["encoder_hidden_states"])
        elif len(args) > 1:
            args = (args[0], shard(args[1])) + tuple(args[2:])
        return args, kwargs

    return hook


def _reshard_joint_sequence(module, args, kwargs):
    # a single-stream block concatenates the text and image streams along the sequence, and
    # dtorch_core's cat gathers a dim sharded in both inputs: the joint sequence is sharded
    # again (a local slice of the gathered tensor) before the block's norm, so its MLP and
    # attention run on sequence shards (and Ulysses) again
    x = args[0] if args else kwargs.get("hidden_states")
    dims = [i for i in _sp_dims(x) if x.placements[i] == Replicate()]
    if not dims:
        return args, kwargs
    wanted = list(x.placements)
    for i in dims:
        wanted[i] = Shard(SEQ)
    x = x.redistribute(x.device_mesh, wanted)
    if args:
        return (x,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def prepare(model: nn.Module) -> None:
    """Install dtorch's attention processor and the sequence-parallel hooks (once)."""
    if getattr(model, _HOOKED, False):
        return
    model.set_attn_processor(DtorchFluxAttnProcessor())
    model.register_forward_pre_hook(_sequence_shard_inputs(model), with_kwargs=True)
    for block in model.single_transformer_blocks:
        block.norm.register_forward_pre_hook(_reshard_joint_sequence, with_kwargs=True)
    setattr(model, _HOOKED, True)


def flux_tp_plan(model: nn.Module) -> dict:
    """The tp plan of a FluxTransformer2DModel. (It also installs the Ulysses attention
    processor and the "sp" entry hook: the family's only call at parallelize time.)"""
    prepare(model)
    colwise, rowwise = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    plan = {}
    if len(model.transformer_blocks):
        attn = "transformer_blocks.*.attn"
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{attn}.{proj}"] = colwise()
        plan[f"{attn}.to_out.0"] = rowwise()
        plan[f"{attn}.to_add_out"] = rowwise()
        for ff in ("ff", "ff_context"):
            plan[f"transformer_blocks.*.{ff}.net.0.proj"] = colwise()
            plan[f"transformer_blocks.*.{ff}.net.2"] = rowwise()
    if len(model.single_transformer_blocks):
        for proj in ("to_q", "to_k", "to_v"):
            plan[f"single_transformer_blocks.*.attn.{proj}"] = colwise()
        plan["single_transformer_blocks.*.proj_mlp"] = colwise()
        plan["single_transformer_blocks.*.proj_out"] = rowwise()
    return plan


FLUX_FAMILY = ModelFamily(
    name="flux",
    model_classes=("FluxTransformer2DModel",),
    dims=frozenset({"tp", "sp", "cfg", "dp"}),
    tp_plan=flux_tp_plan,
    batch_kwargs=BATCH_INPUTS,
    sp_modes=("ulysses", "ring"),
)
